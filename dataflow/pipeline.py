"""``Pipeline``: the standard training graph from a model, a loss and an optimizer."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from dataflow.core.errors import ConfigError
from dataflow.graph import Graph
from dataflow.history.result import FitResult
from dataflow.schedule import Fixed, LRDecay, Schedule
from dataflow.stages import AllReduce, Backward, Evaluate, Forward, Load, Transform, Update
from dataflow.stages.evaluate import graph_eval_transforms, is_random
from dataflow.trainer import Trainer
from dataflow.trainer_config import TrainerConfig, check_options


class Pipeline:
    """Load -> Transform* -> Forward -> Backward -> AllReduce -> Update [-> Evaluate].

    ``model`` is a factory called once per replica (a class, or ``lambda: Net()``);
    ``optimizer`` takes the parameters (``lambda p: torch.optim.SGD(p, lr=0.1)``).
    To train, give ``optimizer``, ``source`` and ``schedule``; a pipeline made without
    all three (``Pipeline(model=Net, loss=..., transforms=[...])``) scores and writes the
    outputs of a trained model (:meth:`evaluate`, :meth:`predict`) and trains nothing.
    ``eval_source`` evaluates at the end of every epoch (every ``eval_every`` epochs):
    the held-out loss (``eval_loss``) and each of ``metrics`` (``eval_<name>``; a
    ``"loss"`` entry replaces the training loss function there).
    ``lr_decay``: a warmup and a decay of the LR over the whole fit, on top of the
    schedule's (``dataflow.schedule.CosineDecay(warmup_epochs=5)``,
    ``StepDecay({30: 0.1, 60: 0.01})``; each step's LR in ``history.steps``).
    ``on_non_finite``: a NaN/inf loss or gradient stops the fit before the update
    (``"raise"``, :class:`~dataflow.errors.NonFiniteError`) or drops that step (``"skip"``:
    weights, optimizer state and buffers stay as before it; ``history.steps`` flags it).
    ``clip_grad_norm``: scale each update's gradient to a norm of at most this (the
    global batch's gradient, as ``torch.nn.utils.clip_grad_norm_`` in a one-process
    loop); each step's norm before clipping is in ``history.steps`` (``grad_norm``);
    ``float("inf")`` records it without clipping.
    ``ema_decay``: keep a moving average of the weights, updated after every step
    (``0.999``: about the last 1,000 steps), returned as ``result.ema_model``;
    ``ema_warmup=True``: its decay grows with its updates, ``min(ema_decay, (1 + n) /
    (10 + n))``, for fits too short for the decay.
    ``sync_batchnorm``: BatchNorm layers normalise with the global batch's statistics,
    reduced over the replicas every forward (torch's SyncBatchNorm), so W replicas on
    any split equal one process; False: each replica its own local batch's, as DDP.
    ``allreduce_dtype``: "fp32" (exact), or "bf16" to halve the bytes each gradient
    allreduce moves (synchronous updates; parameters and optimizer stay fp32).
    ``data_on_device``: on a GPU, an in-memory source is uploaded once and each batch
    gathered there ("auto": when it fits in a quarter of the free device memory).
    ``decode_threads``: threads per replica decoding a chunked source's chunks (zarr,
    dask; "auto": min(4, the replica's cores); the batches do not depend on it).
    Everything else (``replicas``, ``device``, ``precision``, ``channels_last``,
    ``compile``, ``window_seconds``, ``balancer``,
    ``progress`` ...) is a :class:`~dataflow.trainer.TrainerConfig` field.
    """

    def __init__(
        self,
        *,
        model: Callable[[], torch.nn.Module] | torch.nn.Module,
        loss: Callable[..., torch.Tensor],
        optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        source: Any = None,
        transforms: Sequence[Callable[[Any], Any]] = (),
        schedule: Schedule | None = None,
        lr_decay: LRDecay | None = None,
        seed: int = 0,
        eval_source: Any = None,
        metrics: dict[str, Callable[..., torch.Tensor]] | None = None,
        eval_every: int = 1,
        bucket_mb: float | None = None,
        allreduce_dtype: str = "fp32",
        prefetch: int = 2,
        drop_last: bool = False,
        buffer_chunks: int = 4,
        data_on_device: bool | str = "auto",
        decode_threads: int | str = "auto",
        on_non_finite: str = "raise",
        clip_grad_norm: float | None = None,
        ema_decay: float | None = None,
        ema_warmup: bool = False,
        sync_batchnorm: bool = False,
        **trainer_options: Any,
    ) -> None:
        own = [name for name in inspect.signature(Pipeline).parameters if name != "trainer_options"]
        check_options(trainer_options, own=own, caller="Pipeline")  # a typo of either kind
        if isinstance(transforms, Callable):  # a single transform
            transforms = [transforms]
        # what evaluate() scores a trained model by: the held-out loss and the metrics
        self.eval_metrics = {"loss": loss, **(metrics or {})}
        training = {"optimizer": optimizer, "source": source, "schedule": schedule}
        missing = [name for name, value in training.items() if value is None]
        if len(missing) == len(training):  # evaluate and predict only
            if eval_source is not None:
                raise ConfigError(
                    "Pipeline(eval_source=...) is scored during a fit: give optimizer=, "
                    "source= and schedule= to train, or score a model with "
                    "pipe.evaluate(eval_source, model)"
                )
            self.graph = None
            self.trainer = None
            self.config = TrainerConfig(seed=seed, **trainer_options)
            self._eval_transforms = tuple(
                stage for stage in map(Transform, transforms) if not is_random(stage.config.fn)
            )
            Forward(model, loss, sync_batchnorm=sync_batchnorm)  # (its checks of both)
            return
        if missing:
            raise ConfigError(
                f"Pipeline: to train, give optimizer=, source= and schedule= (missing: "
                f"{', '.join(f'{name}=' for name in missing)}; e.g. schedule="
                "dataflow.schedule.Fixed(batch_size=64)); to evaluate or predict with a "
                "trained model only, give none of them"
            )
        graph = Graph()
        node = graph.add(
            Load(
                source,
                prefetch=prefetch,
                drop_last=drop_last,
                buffer_chunks=buffer_chunks,
                data_on_device=data_on_device,
                decode_threads=decode_threads,
            )
        )
        for fn in transforms:
            node = graph.add(Transform(fn), node)
        node = graph.add(Forward(model, loss, sync_batchnorm=sync_batchnorm), node)
        node = graph.add(Backward(), node)
        node = graph.add(AllReduce(bucket_mb=bucket_mb, dtype=allreduce_dtype), node)
        update = Update(
            optimizer,
            on_non_finite=on_non_finite,
            clip_grad_norm=clip_grad_norm,
            ema_decay=ema_decay,
            ema_warmup=ema_warmup,
        )
        node = graph.add(update, node)
        if eval_source is not None:
            # the held-out loss always (eval_loss), next to the metrics asked for
            metrics = {"loss": loss, **(metrics or {})}
            graph.add(Evaluate(eval_source, metrics=metrics, every_epochs=eval_every), node)
        elif metrics:
            raise ConfigError(
                "Pipeline(metrics=...) needs eval_source=... to evaluate on during the fit; "
                "to score a test set after it instead, give them to pipe.evaluate(test, "
                "model, metrics={'loss': loss, ...}), or to a pipeline made to evaluate "
                "only (without optimizer=, source= and schedule=)"
            )
        self.graph = graph
        self.trainer = Trainer(
            graph, schedule=schedule, lr_decay=lr_decay, seed=seed, **trainer_options
        )
        self.config = self.trainer.config
        self._eval_transforms = graph_eval_transforms(graph)

    def _training(self, what: str) -> Trainer:
        """The trainer, or a ConfigError for a pipeline made to evaluate and predict only."""
        if self.trainer is None:
            raise ConfigError(
                f"Pipeline.{what} needs a pipeline made to train: this one was made without "
                "optimizer=, source= and schedule= (for evaluate and predict only); give "
                "them, e.g. schedule=dataflow.schedule.Fixed(batch_size=64)"
            )
        return self.trainer

    def fit(
        self,
        epochs: int,
        client: Any = None,
        *,
        checkpoint_dir: Any = None,
        resume: bool = False,
        keep_checkpoints: int = 3,
        checkpoint_every: int | None = None,
        on_epoch: Any = None,
        keep_best: Any = None,
    ) -> FitResult:
        """Train for ``epochs`` on ``client`` (None: an embedded LocalCluster).

        ``checkpoint_dir``: write a checkpoint at every phase boundary there, and every
        ``checkpoint_every`` windows inside a phase; ``resume=True``: continue from the
        newest valid one (see ``Trainer.fit``). ``on_epoch``: a function of (epoch record,
        history), or a list of them (``dataflow.EarlyStopping(...)``), called on the driver
        after each epoch; one that raises ``dataflow.StopTraining`` ends the fit at that
        epoch's end (:mod:`dataflow.callbacks`). ``keep_best="eval_loss"`` (or
        ``dataflow.KeepBest(...)``): keep the weights of the epoch where that metric was
        best, as ``result.best_model`` and ``best.pt`` in ``checkpoint_dir``.
        """
        return self._training("fit").fit(
            epochs,
            client,
            checkpoint_dir=checkpoint_dir,
            resume=resume,
            keep_checkpoints=keep_checkpoints,
            checkpoint_every=checkpoint_every,
            on_epoch=on_epoch,
            keep_best=keep_best,
        )

    def evaluate(
        self,
        source: Any,
        model: torch.nn.Module,
        *,
        client: Any = None,
        metrics: dict[str, Callable[..., torch.Tensor]] | None = None,
        batch_size: int = 256,
    ) -> dict[str, float]:
        """Score a trained ``model`` (``result.best_model``, ``result.model``) on
        ``source``, a test set: each metric's mean over every sample, and ``samples``.
        The metrics are the fit's (``loss`` and ``Pipeline(metrics=...)``) unless given;
        the pipeline's deterministic transforms are applied, as in its evaluation.
        ``client``: spread over a ``distributed.Client``'s workers (None: in this
        process). See :func:`dataflow.evaluation.evaluate`."""
        from dataflow.evaluation import evaluate

        return evaluate(
            model,
            source,
            metrics=metrics or self.eval_metrics,
            transforms=self._eval_transforms,
            batch_size=batch_size,
            client=client,
            device=self.config.device,
        )

    def predict(
        self,
        source: Any,
        model: torch.nn.Module,
        out: str | Path,
        *,
        client: Any = None,
        name: str = "prediction",
        batch_size: int = 256,
        chunk_mb: float = 8.0,
        stitch: bool = False,
        memory_mb: float = 1024.0,
        blend: str = "mean",
    ) -> str:
        """Write a trained ``model``'s output on every sample of ``source`` to the array
        ``name`` of a new zarr group at ``out`` (row ``i``: sample ``i``'s output; a zarr
        store there is replaced). The pipeline's deterministic transforms are applied, as
        in its evaluation. ``client``: each worker writes a share of whole chunks (``out``
        must be a folder every worker can write to); None: in this process. Returns
        ``out``; read it with ``zarr.open_group(out)[name]``. See
        :mod:`dataflow.prediction`.

        ``stitch=True`` (a ``PatchSource``, a model whose output has the window's shape
        after its channels): the windows' outputs are put back into the field, each cell
        the mean over the windows covering it (``blend="gaussian"``: weighted towards
        each window's centre), NaN where none does; a forecast (``y_shift=``,
        ``y_patch=``) into y's field, each output where its y window lies; ``memory_mb``
        bounds the sums a worker holds at once. See :mod:`dataflow.stitching`."""
        from dataflow.prediction import predict
        from dataflow.stitching import predict_field

        stage = Evaluate(
            source,
            metrics=self.eval_metrics,  # (not computed: predict keeps the outputs)
            batch_size=batch_size,
            transforms=self._eval_transforms,
        )
        where = str(out) if "://" in str(out) else str(Path(out).resolve())  # (workers' cwd)
        if blend != "mean" and not stitch:
            raise ConfigError(
                f"predict(blend={blend!r}) weighs overlapping windows when they are put "
                "back into the field: pass stitch=True too (rows need no blending)"
            )
        common = dict(name=name, client=client, device=self.config.device)
        if stitch:
            return predict_field(
                model,
                stage,
                where,
                chunk_mb=chunk_mb,
                memory_mb=memory_mb,
                blend=blend,
                **common,
            )
        return predict(model, stage, where, chunk_mb=chunk_mb, **common)

    def sample_plan(self, epochs: int, replicas: int) -> list:
        """Per global step, each replica's sample indices (see ``Trainer.sample_plan``)."""
        return self._training("sample_plan").sample_plan(epochs, replicas)

    def plan(self, epochs: int, replicas: int, *, step_seconds: float | None = None) -> list:
        """The phase plans, without a cluster (``print`` them, or ``to_dot()``)."""
        return self._training("plan").plan(epochs, replicas, step_seconds=step_seconds)


__all__ = ["Fixed", "Pipeline"]
