"""The bad-input catalogue (docs/errors.md): each input mistake, made through the public
API, raises its documented error class with its documented message.

Most mistakes are caught before any cluster starts: configs are validated when they
are built, and ``fit`` runs one tiny step on the driver (the dry run) before it touches
the client. Those cases pass :data:`NO_CLUSTER` as the client, so a mistake that slips
past the dry run fails the test at once instead of starting a LocalCluster. The few
mistakes only a cluster can show are in ``test_mistake_on_a_cluster`` (slow).

Mistakes the engine does not catch well yet are ``xfail(strict=True)`` cases with the
check they need as the reason; docs/errors.md lists them under "Not caught yet".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zarr
from conftest import TinyCNN, make_data, tiny_pipeline
from distributed import Client, LocalCluster

import dataflow as dfl
from dataflow import stages
from dataflow.errors import CheckpointError, DataflowError
from dataflow.ops import OpError

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


class _NoCluster(Client):
    """A stand-in client: any use of it means fit() got past its driver-side checks."""

    def __init__(self) -> None:  # no scheduler: nothing is started
        pass

    def __getattribute__(self, name: str) -> Any:
        raise AssertionError(
            f"fit() reached the cluster (client.{name}): the mistake was not caught on the "
            "driver before any worker is used"
        )

    def __del__(self) -> None:
        pass


NO_CLUSTER = _NoCluster()


@dataclass(frozen=True)
class Mistake:
    """``make(tmp_path)`` (on a cluster: ``make(client, empty_cluster)``) makes the
    mistake; it must raise exactly ``error`` with a message matching ``match``
    (``re.search``), and, for an error raised in a stage, a note (``__notes__``)
    matching ``note``."""

    id: str
    make: Callable[..., Any]
    error: type[BaseException]
    match: str
    note: str | None = None


def pipe(**options: Any) -> dfl.Pipeline:
    """TinyCNN on 64 samples, Fixed(16), SGD; ``options`` override any Pipeline argument."""
    x, y = make_data(64)
    return tiny_pipeline(x, y, **options)


def fit(**options: Any) -> Any:
    """One epoch that must fail before it reaches a cluster."""
    return pipe(**options).fit(1, client=NO_CLUSTER)


def zarr_store(tmp_path: Path) -> Path:
    """make_data(64) as a zarr store, 7 samples per chunk of x (10 chunks)."""
    x, y = make_data(64)
    return Path(dfl.io.to_zarr(tmp_path / "train.zarr", x, y, chunk_mb=0.002))


def x_chunks(store: Path) -> list[Path]:
    files = sorted(p for p in (store / "x" / "c").rglob("*") if p.is_file())
    assert len(files) > 1
    return files


# -- the mistakes -------------------------------------------------------------------


def delete_every_chunk_of_x(tmp_path: Path) -> Any:
    store = zarr_store(tmp_path)
    for chunk in x_chunks(store):
        chunk.unlink()
    return fit(source=dfl.io.ZarrSource(store, "x", "y"))


def overwrite_every_chunk_of_x(tmp_path: Path) -> Any:
    store = zarr_store(tmp_path)
    for chunk in x_chunks(store):
        chunk.write_bytes(b"not zstd at all" * 8)
    return fit(source=dfl.io.ZarrSource(store, "x", "y"))


def empty_zarr_array(tmp_path: Path) -> Any:
    group = zarr.open_group(tmp_path / "empty.zarr", mode="w")
    group.create_array("x", shape=(0, 8), dtype="f4")
    return dfl.io.ZarrSource(tmp_path / "empty.zarr", "x")


def corrupt_zarr_metadata(tmp_path: Path) -> Any:
    store = zarr_store(tmp_path)
    (store / "x" / "zarr.json").write_text("{not json")
    return dfl.io.ZarrSource(store, "x", "y")


def zarr_metadata_without_its_keys(tmp_path: Path) -> Any:
    store = zarr_store(tmp_path)
    (store / "y" / "zarr.json").write_text('{"attributes": {}}')  # JSON, but no zarr metadata
    return dfl.io.ZarrSource(store, "x", "y")


def fit_on_an_unreachable_address(tmp_path: Path) -> Any:
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):  # nothing listens there
        return pipe().fit(1, client="tcp://127.0.0.1:1")


def checkpoint_dir_under_a_file(tmp_path: Path) -> Any:
    (tmp_path / "results").write_text("a file, not a folder")
    return pipe().fit(1, client=NO_CLUSTER, checkpoint_dir=tmp_path / "results" / "ckpt")


def graph_without_load(tmp_path: Path) -> Any:
    g = dfl.Graph()
    out = g.add(stages.Forward(TinyCNN, F.cross_entropy))
    g.add(stages.Update(lambda p: torch.optim.SGD(p, lr=0.1)), g.add(stages.Backward(), out))
    return dfl.Trainer(g, schedule=dfl.schedule.Fixed(8))


def regression_data() -> dfl.io.ArraySource:
    x, _ = make_data(64)
    return dfl.io.ArraySource(x, np.linspace(0, 1, 64, dtype=np.float32))  # y: shape (64,)


def float64_data() -> dfl.io.ArraySource:
    x, y = make_data(64)
    return dfl.io.ArraySource(x.astype(np.float64), y)


def nan_data() -> dfl.io.ArraySource:
    _, y = make_data(64)
    return dfl.io.ArraySource(np.full((64, 1, 8, 8), np.nan, np.float32), y)


def one_output() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 1))  # output (N, 1)


CAUGHT = [
    # -- configuration, checked when it is built ---------------------------------------
    Mistake(
        "fixed-negative-lr",
        lambda _: dfl.schedule.Fixed(64, lr=-0.1),
        dfl.ConfigError,
        r"^Fixed\(lr=-0\.1\): lr must be a number > 0, or None",
    ),
    Mistake(
        "fixed-batch-as-string",
        lambda _: dfl.schedule.Fixed("64"),
        dfl.BatchSizeError,
        r"^Fixed\(batch_size=\.\.\.\) must be an int, got str",
    ),
    Mistake(
        "stepwise-table-as-list",
        lambda _: dfl.schedule.Stepwise([64, 256]),
        dfl.ConfigError,
        r"^Stepwise\(batches=\[64, 256\]\): give a dict \{epoch: global batch\}",
    ),
    Mistake(
        "stepwise-negative-warmup",
        lambda _: dfl.schedule.Stepwise({0: 8}, warmup_steps=-1),
        dfl.ConfigError,
        r"^Stepwise\(warmup_steps=-1\): must be >= 0",
    ),
    Mistake(
        "lr-decay-not-a-decay",
        lambda _: pipe(lr_decay="cosine"),
        dfl.ConfigError,
        r"^lr_decay='cosine': give a dataflow\.schedule decay such as CosineDecay",
    ),
    Mistake(
        "lr-decay-warmup-outlasts-the-fit",
        lambda _: pipe(lr_decay=dfl.schedule.CosineDecay(warmup_epochs=5)).plan(3, 2),
        dfl.ConfigError,
        r"^CosineDecay\(warmup_epochs=5\) over 3 epochs leaves nothing to decay over",
    ),
    Mistake(
        "schedule-not-a-schedule",
        lambda _: pipe(schedule=64),
        dfl.ConfigError,
        r"^schedule must be a dataflow\.schedule schedule such as Fixed\(64\), got int",
    ),
    Mistake(
        "replicas-as-string",
        lambda _: pipe(replicas="2"),
        dfl.ConfigError,
        r"^replicas must be an int >= 1 or None, got '2'",
    ),
    Mistake(
        "threads-per-replica-zero",
        lambda _: pipe(threads_per_replica=0),
        dfl.ConfigError,
        r"^threads_per_replica must be >= 1, got 0",
    ),
    Mistake(
        "collective-timeout-zero",
        lambda _: pipe(collective_timeout_s=0),
        dfl.ConfigError,
        r"^collective_timeout_s must be > 0, got 0",
    ),
    Mistake(
        "max-micro-batch-zero",
        lambda _: pipe(max_micro_batch=0),
        dfl.ConfigError,
        r"^max_micro_batch=0: give the most samples one replica can hold",
    ),
    Mistake(
        "max-micro-batch-one-per-replica",
        lambda _: pipe(max_micro_batch=(8, 8, 8)).plan(epochs=1, replicas=2),
        dfl.ConfigError,
        r"^max_micro_batch has 3 values but the fit has 2 replicas",
    ),
    Mistake(
        "max-workers-zero",
        lambda _: pipe(max_workers=0),
        dfl.ConfigError,
        r"^max_workers must be an int >= 1 or None, got 0",
    ),
    Mistake(
        "max-workers-below-one-replica",
        lambda _: pipe(max_workers=1, layout=dfl.Layout(spatial=2)),
        dfl.ConfigError,
        r"^max_workers=1 is fewer than the 2 workers one replica of Layout\(spatial=2\) needs",
    ),
    Mistake(
        "scale-timeout-zero",
        lambda _: pipe(scale_timeout_s=0),
        dfl.ConfigError,
        r"^scale_timeout_s must be > 0, got 0",
    ),
    Mistake(
        "throttle-below-one",
        lambda _: pipe(throttle={1: 0.5}),
        dfl.ConfigError,
        r"^throttle=\{1: 0\.5\}: give \{rank: factor\} with factors >= 1",
    ),
    Mistake(
        "buffer-chunks-zero",
        lambda _: pipe(buffer_chunks=0),
        dfl.ConfigError,
        r"^Load\(buffer_chunks=0\): the shuffle buffer mixes samples",
    ),
    Mistake(
        "metrics-without-eval-source",
        lambda _: pipe(metrics={"acc": lambda out, y: out.mean()}),
        dfl.ConfigError,
        r"^Pipeline\(metrics=\.\.\.\) needs eval_source=\.\.\.",
    ),
    Mistake(
        "metric-not-callable",
        lambda _: pipe(eval_source=dfl.io.ArraySource(*make_data(8)), metrics={"acc": 3}),
        dfl.ConfigError,
        r"^Evaluate\(metrics=\{'acc': \.\.\.\}\): metric must be callable",
    ),
    Mistake(
        "graph-not-a-graph",
        lambda _: dfl.Trainer("Load -> Forward", schedule=dfl.schedule.Fixed(8)),
        dfl.ConfigError,
        r"^Trainer\(graph=\.\.\.\) expects a dataflow\.Graph, got <class 'str'>",
    ),
    Mistake("graph-without-load", graph_without_load, dfl.ConfigError, r"^the graph has no Load"),
    Mistake(
        "loss-not-callable",
        lambda _: pipe(loss="cross_entropy"),
        dfl.ConfigError,
        r"^Forward\(loss=\.\.\.\): expected a function \(output, y\) -> scalar tensor, got str",
    ),
    Mistake(
        "optimizer-instance-not-factory",
        lambda _: pipe(optimizer=torch.optim.SGD(TinyCNN().parameters(), lr=0.1)),
        dfl.ConfigError,
        r"^Update\(optimizer=\.\.\.\): expected a factory taking the parameters",
    ),
    Mistake(
        "transform-not-callable",
        lambda _: pipe(transforms=["log1p"]),
        dfl.ConfigError,
        r"^Transform\(fn=\.\.\.\): expected a callable on tensors, got str",
    ),
    # -- data sources and stores, checked when the source is opened --------------------
    Mistake(
        "zarr-store-not-found",
        lambda tmp: dfl.io.ZarrSource(tmp / "nowhere.zarr", "x", "y"),
        dfl.DataError,
        r"^ZarrSource\(store='.*nowhere\.zarr'\): no zarr array or group there",
    ),
    Mistake(
        "zarr-store-wrong-type",
        lambda _: dfl.io.ZarrSource(42),
        dfl.DataError,
        r"^ZarrSource\(store=\.\.\.\): got int; pass a path, an fsspec URL",
    ),
    Mistake(
        "zarr-y-several-names",
        lambda tmp: dfl.io.ZarrSource(zarr_store(tmp), "x", ["y", "label"]),
        dfl.DataError,
        r"^ZarrSource\(y=\['y', 'label'\]\): y is one array name \(or None\)",
    ),
    Mistake(
        "zarr-x-empty-list",
        lambda tmp: dfl.io.ZarrSource(zarr_store(tmp), []),
        dfl.DataError,
        r"^ZarrSource\(x=\(\)\): name at least one array, or pass None",
    ),
    Mistake(
        "zarr-sample-dim-float",
        lambda tmp: dfl.io.ZarrSource(zarr_store(tmp), "x", sample_dim=1.5),
        dfl.DataError,
        r"^ZarrSource\(sample_dim=1\.5\): must be an axis \(int, e\.g\. 0\) or a dimension name",
    ),
    Mistake(
        "zarr-empty-array",
        empty_zarr_array,
        dfl.DataError,
        r"^ZarrSource: x \('x'\) has no samples along sample_dim",
    ),
    Mistake(
        "to-zarr-chunk-mb-zero",
        lambda tmp: dfl.io.to_zarr(tmp / "a.zarr", make_data(8)[0], chunk_mb=0),
        dfl.ConfigError,
        r"^to_zarr\(chunk_mb=0\): must be a positive number",
    ),
    Mistake(
        "to-zarr-same-names",
        lambda tmp: dfl.io.to_zarr(tmp / "a.zarr", *make_data(8), x_name="data", y_name="data"),
        dfl.ConfigError,
        r"^to_zarr: x_name and y_name are both 'data'; give y another name",
    ),
    Mistake(
        "to-zarr-list",
        lambda tmp: dfl.io.to_zarr(tmp / "a.zarr", [[0.0, 1.0], [2.0, 3.0]]),
        dfl.DataError,
        r"^to_zarr: x must be a numpy array or a torch tensor, got list",
    ),
    # -- fit(): checked on the driver before anything trains ----------------------------
    Mistake(
        "epochs-as-string",
        lambda _: pipe().fit("3"),
        dfl.ConfigError,
        r"^fit\(epochs='3'\): epochs must be an int >= 1",
    ),
    Mistake(
        "later-phase-batch-larger-than-dataset",
        lambda _: fit(schedule=dfl.schedule.Stepwise({0: 16, 2: 128})),
        dfl.BatchSizeError,
        r"^schedule asks for a global batch of 128 but the dataset has 64 samples",
    ),
    Mistake(
        "checkpoint-dir-under-a-file",
        checkpoint_dir_under_a_file,
        CheckpointError,
        r"^checkpoint directory '.*results/ckpt' is not writable",
    ),
    Mistake(
        "keep-checkpoints-zero",
        lambda tmp: pipe().fit(1, client=NO_CLUSTER, checkpoint_dir=tmp, keep_checkpoints=0),
        dfl.ConfigError,
        r"^CheckpointStore\(keep=0\): keep must be an int >= 1",
    ),
    Mistake(
        "checkpoint-every-zero",
        lambda tmp: pipe().fit(1, client=NO_CLUSTER, checkpoint_dir=tmp, checkpoint_every=0),
        dfl.ConfigError,
        r"^fit\(checkpoint_every=0\): give the number of windows between checkpoints",
    ),
    Mistake(
        "checkpoint-every-without-a-folder",
        lambda tmp: pipe().fit(1, client=NO_CLUSTER, checkpoint_every=100),
        dfl.ConfigError,
        r"^fit\(checkpoint_every=100\) needs checkpoint_dir=",
    ),
    # -- fit(): the dry run, one step of two samples on the driver ----------------------
    Mistake(
        "model-factory-raises",
        lambda _: fit(model=lambda: TinyCNN(classes=-1)),
        RuntimeError,  # the factory's own error, unchanged, with its traceback
        r"^Trying to create tensor with negative dimension -1",
    ),
    Mistake(
        "loss-returns-float",
        lambda _: fit(loss=lambda out, y: F.cross_entropy(out, y).item()),
        dfl.LossError,
        r"^loss function '<lambda>' returned float, not a scalar tensor",
    ),
    Mistake(
        "optimizer-factory-raises",
        lambda _: fit(optimizer=lambda params: torch.optim.SGD(params, lr=-0.1)),
        ValueError,  # torch's own check of the LR, raised in the dry run
        r"^Invalid learning rate: -0\.1",
    ),
    Mistake(
        "labels-out-of-range",
        lambda _: fit(source=dfl.io.ArraySource(make_data(64)[0], make_data(64)[1] + 3)),
        dfl.io.LabelError,  # the dry run's own samples, checked before the loss
        r"^label [3-5] of sample \d+ in y of ArraySource\(x=\(64, 1, 8, 8\), y=\(64,\), "
        r"shuffle=True\) is not a class of the model: valid labels are 0 to 2",
        note=r"^in stage 'Forward' on replica 0, step 0$",
    ),
    Mistake(
        "transform-axes-out-of-range",
        lambda _: fit(transforms=[dfl.ops.RandomFlip(axes=(4,))]),
        OpError,
        r"^RandomFlip: axes \(4,\) do not exist in a tensor of shape \(2, 1, 8, 8\)",
    ),
    Mistake(
        "standardize-channel-count",
        lambda _: fit(transforms=[dfl.ops.Standardize(mean=[0.0, 0.0], std=[1.0, 1.0])]),
        OpError,
        r"^Standardize: x has 1 channels .* but mean/std have 2",
    ),
    Mistake(
        "nan-in-every-sample",
        lambda _: fit(source=nan_data()),
        dfl.NonFiniteError,
        r"^non-finite loss or gradient at step 0 \(epoch 0, phase 0\) on replica 0; no update",
    ),
    Mistake(
        "missing-chunk-in-dry-run",
        delete_every_chunk_of_x,
        dfl.ChunkMissingError,
        r"^ZarrSource: array 'x' has no chunk 'x/c/\d+/0/0/0' .*the store is incomplete",
    ),
    Mistake(
        "corrupt-chunk-in-dry-run",
        overwrite_every_chunk_of_x,
        dfl.ChunkReadError,
        r"'x/c/\d+/0/0/0'.*corrupt",
    ),
    Mistake(
        "optimizer-ignores-its-parameters",
        lambda _: fit(optimizer=lambda p: torch.optim.SGD(torch.nn.Linear(2, 2).parameters())),
        dfl.ModelError,
        r"optimizer .*none of the model's parameters",
    ),
    Mistake(
        "misspelled-pipeline-option",
        lambda _: pipe(replica=2),
        dfl.ConfigError,
        r"replica=2.*did you mean 'replicas'",
    ),
    Mistake(  # one of the Pipeline's own parameters, misspelled
        "misspelled-pipeline-parameter",
        lambda _: pipe(ema_decya=0.99),
        dfl.ConfigError,
        r"^unknown option ema_decya=0\.99; did you mean 'ema_decay'\?\. Valid options: "
        r"Pipeline's own: model, loss, .*ema_decay.*; and how the fit runs: seed, ",
    ),
    Mistake(
        "unknown-option-far-from-any",
        lambda _: pipe(zzz=1),
        dfl.ConfigError,
        r"^unknown option zzz=1\. Valid options: ",
    ),
    Mistake(
        "schedule-class-not-instance",
        lambda _: fit(schedule=dfl.schedule.Fixed),
        dfl.ConfigError,
        r"schedule=.*Fixed.* is a class; pass an instance, e\.g\. Fixed\(",
    ),
    Mistake(
        "loss-broadcasts-output-and-target",
        lambda _: fit(model=one_output, loss=F.mse_loss, source=regression_data()),
        dfl.LossError,
        r"^loss function 'mse_loss' got an output of shape \(2, 1\) and a target of shape "
        r"\(2,\): they broadcast to \(2, 2\).*output\.squeeze\(-1\)",
        note=r"^in stage 'Forward' on replica 0, step 0$",
    ),
    Mistake(
        "x-dtype-differs-from-model",
        lambda _: fit(source=float64_data()),
        dfl.DataError,
        r"^x is float64 but the model's parameters are float32; cast the data to float32 .*"
        r"x\.astype\(numpy\.float32\).*Net\(\)\.double\(\)",
    ),
    Mistake(
        "model-dtype-differs-from-x",
        lambda _: fit(model=lambda: TinyCNN().double()),
        dfl.DataError,
        r"^x is float32 but the model's parameters are float64; cast the data to float64",
    ),
    Mistake(
        "x-integer-dtype",
        lambda _: fit(
            source=dfl.io.ArraySource(make_data(64)[0].astype(np.int64), make_data(64)[1])
        ),
        dfl.DataError,
        r"^x is int64 but the model's parameters are float32; cast the data to float32 .*"
        r"x\.astype\(numpy\.float32\).*torch said: Input type \(long int\)",
    ),
    Mistake(
        "model-on-meta-device",
        lambda _: fit(model=lambda: TinyCNN().to("meta")),
        dfl.ConfigError,
        r"^model factory '<lambda>' built the model on the meta device: its parameters "
        r"\(e\.g\. 'conv\.weight'\) have a shape but no values.*to_empty\(device='cpu'\)",
    ),
    Mistake(
        "loss-needs-targets-but-source-has-none",
        lambda _: fit(source=dfl.io.ArraySource(make_data(64)[0])),
        dfl.LossError,
        r"^loss function 'cross_entropy' needs targets, loss\(output, y\), but the source has "
        r"no y",
    ),
    Mistake(
        "array-source-scalar",
        lambda _: dfl.io.ArraySource(np.array(1.5, dtype=np.float32)),
        dfl.DataError,
        r"^ArraySource: x is a scalar \(a 0-d array\); it needs a leading sample dimension",
    ),
    Mistake(
        "zarr-corrupt-metadata",
        corrupt_zarr_metadata,
        dfl.DataError,
        r"^ZarrSource\(store='.*train\.zarr'\): the metadata file .*train\.zarr/x/zarr\.json is "
        r"corrupt: not valid JSON .*; re-write the store",
    ),
    Mistake(
        "zarr-metadata-without-its-keys",
        zarr_metadata_without_its_keys,
        dfl.DataError,
        r"the metadata file .*train\.zarr/y/zarr\.json is corrupt: the key\(s\) "
        r"\['zarr_format', 'node_type'\] that every zarr\.json has are missing",
    ),
    Mistake(
        "client-address-unreachable",
        fit_on_an_unreachable_address,
        dfl.ConfigError,
        r"^client='tcp://127\.0\.0\.1:1': no Dask scheduler answered at that address",
    ),
    Mistake(
        "client-not-a-client",
        lambda _: pipe().fit(1, client=4),
        dfl.ConfigError,
        r"^client=4 \(int\) is not a client; pass a distributed\.Client, a scheduler address",
    ),
]


def not_caught(mistake: Mistake, reason: str) -> Any:
    return pytest.param(mistake, marks=pytest.mark.xfail(strict=True, reason=reason), id=mistake.id)


NOT_CAUGHT: list = []

# Caught since: checks added to TrainerConfig, Fixed/Stepwise and LoadConfig.
CAUGHT_SINCE = [
    Mistake(
        "window-seconds-as-string",
        lambda _: pipe(window_seconds="1"),
        dfl.ConfigError,
        r"^window_seconds must be a number",
    ),
    Mistake(
        "schedule-lr-as-string",
        lambda _: dfl.schedule.Fixed(64, lr="0.1"),
        dfl.ConfigError,
        r"^Fixed\(lr='0\.1'\): lr must be a number",
    ),
    Mistake(
        "balancer-as-string",
        lambda _: pipe(balancer="throughput"),
        dfl.ConfigError,
        r"^balancer must .*got str",
    ),
    Mistake(
        "drop-last-as-string",
        lambda _: pipe(drop_last="no"),
        dfl.ConfigError,
        r"^Load\(drop_last='no'\): must be True or False",
    ),
]


def check(mistake: Mistake, *args: Any) -> None:
    with pytest.raises(mistake.error) as info:
        mistake.make(*args)
    assert type(info.value) is mistake.error, f"{type(info.value).__name__}: {info.value}"
    assert re.search(mistake.match, str(info.value)), str(info.value)
    if mistake.note is not None:
        notes = getattr(info.value, "__notes__", [])
        assert any(re.search(mistake.note, n) for n in notes), notes


@pytest.mark.parametrize("mistake", [*CAUGHT, *CAUGHT_SINCE, *NOT_CAUGHT], ids=lambda m: m.id)
def test_mistake(mistake: Mistake, tmp_path: Path) -> None:
    check(mistake, tmp_path)


# -- mistakes only a cluster shows --------------------------------------------------


@pytest.fixture(scope="module")
def empty_cluster():
    """A scheduler with no workers (in-process, nothing spawned)."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
        yield cluster


def no_workers(client: Client, cluster: LocalCluster) -> Any:
    with Client(cluster, set_as_default=False) as empty:
        return pipe().fit(1, client=empty)


def closed_client(client: Client, cluster: LocalCluster) -> Any:
    closed = Client(cluster, set_as_default=False)
    closed.close()
    return pipe().fit(1, client=closed)


class FactoryError(RuntimeError):
    pass


def failing_factory() -> torch.nn.Module:
    raise FactoryError("no weights file on this node")


CLUSTER_CAUGHT = [
    Mistake(
        "client-with-no-workers",
        no_workers,
        dfl.ConfigError,
        r"^the client has no workers; start some before fit\(\)",
    ),
    Mistake(
        "more-replicas-than-workers",
        lambda client, _: pipe(replicas=3).fit(1, client=client),
        dfl.ConfigError,
        r"^replicas=3 but the client has 2 worker\(s\); start more workers or lower replicas",
    ),
    Mistake(
        "min-workers-above-the-cluster",
        lambda client, _: pipe(min_workers=3).fit(1, client=client),
        dfl.ConfigError,
        r"^min_workers=3, but the fit would start on 2 replica\(s\), below the fewest it may "
        r"go on with; start more workers",
    ),
    Mistake(
        "model-factory-raises-on-a-replica",
        lambda client, _: pipe(model=failing_factory, dry_run=False).fit(1, client=client),
        FactoryError,  # the factory's own error, re-raised on the driver by Dask
        r"^no weights file on this node",
    ),
]

CLUSTER_CAUGHT.append(
    Mistake("closed-client", closed_client, dfl.ConfigError, r"client is closed"),
)
CLUSTER_NOT_CAUGHT: list = []


@pytest.mark.slow
@pytest.mark.parametrize("mistake", [*CLUSTER_CAUGHT, *CLUSTER_NOT_CAUGHT], ids=lambda m: m.id)
def test_mistake_on_a_cluster(mistake: Mistake, client: Client, empty_cluster) -> None:
    check(mistake, client, empty_cluster)


# -- the catalogue page and the tests stay in step ---------------------------------------


def _ids(cases: list) -> set[str]:
    return {c.values[0].id if hasattr(c, "values") else c.id for c in cases}


def test_the_catalogue_lists_every_case_and_points_at_real_tests() -> None:
    text = DOCS.read_text()
    for test, cases in (
        ("test_mistake", [*CAUGHT, *CAUGHT_SINCE, *NOT_CAUGHT]),
        ("test_mistake_on_a_cluster", [*CLUSTER_CAUGHT, *CLUSTER_NOT_CAUGHT]),
    ):
        listed = set(re.findall(rf"`{test}\[([\w-]+)\]`", text))
        assert listed == _ids(cases), f"{test}: docs/errors.md and the cases differ"
    tests = Path(__file__).parent
    for file, name in re.findall(r"`(test_\w+\.py)::(test_\w+)`", text):
        assert re.search(rf"^def {name}\(", (tests / file).read_text(), re.M), f"{file}::{name}"


def test_every_catalogued_class_is_also_a_builtin() -> None:
    """The catalogue's second column: each DataflowError is also a built-in exception."""
    for case in [*CAUGHT, *CLUSTER_CAUGHT]:
        if issubclass(case.error, DataflowError):
            builtin = next(c for c in case.error.__mro__ if c.__module__ == "builtins")
            assert builtin is not Exception, f"{case.id}: {case.error.__name__} is only Exception"
