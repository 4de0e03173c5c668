"""The ``dataflow`` command line: ``demo``, ``convert``, ``info``, ``report`` and ``scale``.

``plot`` is the old name of ``report`` and still works (older instructions use it).

Each command is a thin layer over a library function (``dataflow.tools.convert``,
``dataflow.tools.info``, ``dataflow.history.report``), so everything the CLI does is
also a Python call. A ``DataflowError`` (a bad path, variable, argument) is
printed as one line, without a traceback, and the command exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dataflow.core.errors import ConfigError, DataflowError
from dataflow.tools.storage_flags import add_storage_option, hide_secrets, parse_storage_options


def _demo(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    import dataflow as dfl
    from dataflow.history.report import write_report
    from dataflow.runtime.cluster import client_or_local_cluster
    from dataflow.tools.demo import SLOPES, FieldNet, growing_batches, random_fields

    started = time.perf_counter()
    x, y = random_fields(args.samples + args.eval_samples, size=args.size, seed=args.seed)
    train = dfl.io.ArraySource(x[: args.samples], y[: args.samples])
    held_out = dfl.io.ArraySource(x[args.samples :], y[args.samples :], shuffle=False)
    batches = growing_batches(args.batch, args.epochs, args.samples, grow=not args.fixed_batch)
    print(
        f"dataflow demo: {args.samples} training and {args.eval_samples} held-out "
        f"{args.size}x{args.size} random fields, classes = power-spectrum slopes {SLOPES}; "
        f"global batch by epoch {batches}"
    )
    pipe = dfl.Pipeline(
        model=FieldNet,
        loss=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        source=train,
        eval_source=held_out,
        metrics={"loss": F.cross_entropy, "accuracy": dfl.stages.accuracy},
        schedule=dfl.schedule.Stepwise(batches, lr_scaling="sqrt"),
        seed=args.seed,
        replicas=args.replicas,
    )
    with client_or_local_cluster(None, n_workers=args.workers) as client:
        result = pipe.fit(epochs=args.epochs, client=client)
    out = Path(args.out)
    path = result.history.to_json(out / "history.json")
    torch.save(result.model.state_dict(), out / "model.pt")
    write_report(result.history, out / "report")
    accuracy = result.history.epochs[-1].get("eval_accuracy", float("nan"))
    print(
        f"held-out accuracy {accuracy:.1%} (chance {1 / len(SLOPES):.0%}); history in {path}, "
        f"weights in {out / 'model.pt'}; {time.perf_counter() - started:.0f} s in all"
    )
    print(
        f"report (plots, CSV): {out / 'report'}; open {out / 'report' / 'report.md'}, or "
        f"re-draw it with: dataflow report {path}"
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from dataflow.tools.convert import convert, parse_spatial_chunks
    from dataflow.tools.rechunk import Rechunked

    started = time.perf_counter()
    done = convert(
        args.src,
        args.dest,
        x=args.x,
        y=args.y,
        sample_dim=args.sample_dim,
        chunk_mb=args.chunk_mb,
        zarr_format=args.format,
        overwrite=args.overwrite,
        spatial_chunks=parse_spatial_chunks(args.spatial_chunks),
        chunks=args.chunks,
        fill_missing=args.fill_missing,
        storage_options=parse_storage_options(args.storage_options),
        compressor=None if args.compressor == "none" else args.compressor,
        dtypes=args.dtype,
    )
    if isinstance(done, Rechunked):
        print(
            f"wrote {done.dest} (zarr format {done.zarr_format}, checksummed) in "
            f"{time.perf_counter() - started:.1f} s:"
        )
        for line in done.summary():
            print(f"  {line}")
        print(f"check it with: dataflow info {done.dest}")
        return 0
    shapes = ", ".join(f"{name} {shape}" for name, shape in done.shapes.items())
    print(f"wrote {done.dest} ({shapes}) in {time.perf_counter() - started:.1f} s")
    if done.left_out:
        print(f"not converted: {list(done.left_out)} (not named with --x/--y)")
    print(f"read it with: {done.snippet()}")
    print(f"check it with: dataflow info {done.dest}")
    return 0


def _info(args: argparse.Namespace) -> int:
    """Exit status 1 when ``--verify`` finds a chunk missing, undecodable or out of range."""
    import json

    from dataflow.io.verify import verify_store
    from dataflow.tools.chunk_advice import parse_patch, patch_advice
    from dataflow.tools.info import store_info

    remote = {"storage_options": parse_storage_options(args.storage_options)}
    info = store_info(
        args.store,
        sample_dim=args.sample_dim,
        check_missing=not args.no_check,
        decode_budget_s=0.0 if args.no_decode else args.decode_seconds,
        **remote,
    )
    check = advice = None
    if args.verify:
        check = verify_store(args.store, outlier_factor=args.outlier_factor, **remote)
    if args.patch:
        advice = patch_advice(args.store, parse_patch(args.patch), **remote)
    if args.json:
        out = info.to_dict()
        if check is not None:
            out["verify"] = check.to_dict()
        if advice is not None:
            out["patch"] = advice.to_dict()
        print(json.dumps(out, indent=1))
    else:
        print(info.format())
        if advice is not None:
            print(advice.format())
        if check is not None:
            print(check.format())
    return 0 if check is None or check.ok else 1


def _report(args: argparse.Namespace) -> int:
    from dataflow.history.report import write_report

    source = Path(args.history)
    out = Path(args.out) if args.out else source.parent / "report"
    written = write_report(source, out)
    print(f"wrote {len(written)} files to {out}:")
    for path in written:
        print(f"  {path}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    from dataflow.costmodel import presets, scaling, scaling_table
    from dataflow.costmodel.model import CostModel

    if args.published:
        print(scaling.format_published(scaling.published()))
        return 0
    model = CostModel.load(args.model) if args.model else presets.model(args.preset)
    if args.network:
        model = model.with_network(presets.interconnect(args.network), per_node=args.per_node)
    counts = scaling.worker_counts(args.max_workers)
    per_epoch, dataset = _samples_per_epoch(args, model)
    if args.epochs < 1:
        raise ConfigError(f"--epochs {args.epochs}: give the epochs to train, >= 1")
    size = f"{args.epochs} epochs (--epochs) of {per_epoch:,} samples ({dataset})"
    lines = []
    if args.stepwise or args.adaptive:
        if args.stepwise:
            phases = scaling.stepwise_phases(
                args.stepwise, epochs=args.epochs, samples_per_epoch=per_epoch
            )
            what = f"Stepwise schedule {args.stepwise}"
        else:
            initial, _, final = args.adaptive.partition(":")
            try:
                first, last = int(initial), int(final)
            except ValueError:
                raise ConfigError(
                    f"--adaptive {args.adaptive!r}: write INITIAL:FINAL global batches"
                ) from None
            phases = scaling.adaptive_phases(
                first, last, epochs=args.epochs, samples_per_epoch=per_epoch
            )
            what = f"schedule of a batch doubling each phase from {first} to {last}"
        table = scaling_table.schedule_rows(
            model, phases=phases, samples_per_epoch=per_epoch, counts=counts
        )
        lines.append(f"{model.name or args.model}: {what} over {size}")
        lines += [
            f"  phase {i}: epochs {p.epochs} at global batch {p.step.global_batch:,} "
            f"({p.samples:,} samples)"
            for i, p in enumerate(table[0].phases)
        ]
        rows = scaling.schedule_scaling(model, phases=phases, counts=counts)
        title = f"{model.name}: {what} (terms: the largest batch's phase)"
    else:
        local = (
            args.local_batch
            or int(model.notes.get("local_batch", 0))
            or max(b for b, _ in model.compute.points)
        )
        table = scaling_table.weak_rows(
            model, local_batch=local, epochs=args.epochs, samples_per_epoch=per_epoch, counts=counts
        )
        rows = scaling.weak_scaling(model, local_batch=local, counts=counts)
        what = f"local batch {local} (weak scaling)"
        lines.append(f"{model.name or args.model}: {what}; time for {size}")
        title = f"{model.name}: {what}"
    lines.append(f"topology {model.topology.algorithm}, {model.topology.per_node} per node")
    print("\n".join(lines))
    print(scaling_table.format_table(table))
    print(scaling_table.time_to_train(table, f"{args.epochs} epochs of {per_epoch:,} samples"))
    print("\n".join(scaling_table.explain(model, table)))
    if args.out:
        from dataflow.costmodel.plot import write_scaling_png

        path = write_scaling_png(rows, args.out, title=title)
        print(f"wrote {path}")
    return 0


def _samples_per_epoch(args: argparse.Namespace, model: Any) -> tuple[int, str]:
    """The dataset size, and where it came from: --samples-per-epoch, the size the
    model was calibrated on, or ImageNet's (said so)."""
    from dataflow.costmodel.scaling import IMAGENET_TRAIN

    if args.samples_per_epoch is not None:
        if args.samples_per_epoch < 1:
            raise ConfigError(f"--samples-per-epoch {args.samples_per_epoch}: give an int >= 1")
        return args.samples_per_epoch, "--samples-per-epoch"
    recorded = model.notes.get("samples_per_epoch", "")
    if str(recorded).isdigit() and int(recorded) > 0:
        return int(recorded), "the calibrated source's; --samples-per-epoch for another"
    return IMAGENET_TRAIN, "ImageNet's, the default: give yours with --samples-per-epoch"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataflow",
        description="CNN training as a task graph on a Dask cluster. Commands: demo (train a "
        "small CNN end to end), convert (numpy/HDF5/netCDF to zarr), info (inspect a zarr "
        "store), report (a fit's report from its history.json), scale (predicted scaling "
        "from 1 to 4,096 workers).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small CNN on synthetic random fields on a local Dask cluster",
        description="Makes a small dataset, starts a LocalCluster (one worker process per "
        "core), trains data-parallel with a growing global batch and progress bars, and "
        "writes the history, the weights and a report (plots, CSV) under --out.",
    )
    demo.add_argument("--epochs", type=int, default=6)
    demo.add_argument("--batch", type=int, default=64, help="first global batch size")
    demo.add_argument(
        "--fixed-batch", action="store_true", help="keep --batch all along (default: double it)"
    )
    demo.add_argument("--lr", type=float, default=0.02, help="learning rate at --batch")
    demo.add_argument("--samples", type=int, default=4000, help="training samples")
    demo.add_argument("--eval-samples", type=int, default=1000, help="held-out samples")
    demo.add_argument("--size", type=int, default=32, help="field side length in pixels")
    demo.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: one per core or GPU)"
    )
    demo.add_argument("--replicas", type=int, default=None, help="default: every worker")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--out", default="runs/demo", help="folder for history.json, model.pt and report/"
    )
    demo.set_defaults(run=_demo)

    convert = commands.add_parser(
        "convert",
        help="convert a numpy, HDF5 or netCDF file into a zarr store chunked for streaming, "
        "or rechunk a zarr store",
        description="Writes SRC's arrays into the zarr store DEST, chunked by whole samples "
        "(about --chunk-mb MB a chunk) so training streams it chunk by chunk. Inputs: .npy "
        "(one array), .npz (by name), HDF5 .h5/.hdf5 (dataset paths; needs h5py), netCDF .nc "
        "(variables; needs xarray and a netCDF reader: netCDF4, h5netcdf or scipy). Large "
        "files are read a slab at a time, never whole. A zarr store SRC (v2 or v3, a path or "
        "fsspec URL) is copied with the chunks --chunks gives (the rest kept), its attributes "
        "and dimension names, streamed slab by slab, with checksums; a chunk missing from SRC "
        "is refused, never written as fill values.",
        epilog="examples:\n  dataflow convert fields.npz fields.zarr --x x --y y\n"
        "  dataflow convert sim.nc sim.zarr --x density --y params --sample-dim time\n"
        "  dataflow convert era5.zarr era5-rechunked.zarr --chunks time=64,lat=64,lon=64",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("src", metavar="SRC", help="the file (or zarr store) to convert")
    convert.add_argument("dest", metavar="DEST.zarr", help="the zarr store to write")
    convert.add_argument(
        "--x",
        nargs="+",
        metavar="VAR",
        help="input variable(s) (default: 'x', the only array, or every variable with the "
        "sample dimension; a file holding arrays beyond those and --y is refused, listing them)",
    )
    convert.add_argument("--y", metavar="VAR", help="target variable (default: 'y' if present)")
    convert.add_argument(
        "--sample-dim",
        metavar="DIM",
        help="the dimension that indexes samples: a name (netCDF) or an axis number "
        "(numpy, HDF5; default 0)",
    )
    convert.add_argument(
        "--chunk-mb", type=float, default=None, help="target chunk size in MB (default 8)"
    )
    convert.add_argument(
        "--format",
        type=int,
        choices=(2, 3),
        default=None,
        help="zarr format (default 3; a zarr SRC's own)",
    )
    convert.add_argument(
        "--chunks",
        metavar="DIM=LEN,...",
        help="a zarr SRC's new chunks: dimension names (stores written by xarray) or axis "
        "numbers, e.g. time=64,lat=64,lon=64 or 0=64,1=64; clipped to each array's length; "
        "an array without a dimension keeps its chunks",
    )
    convert.add_argument(
        "--fill-missing",
        action="store_true",
        help="write chunks absent from a zarr SRC as its fill value (only when its writer "
        "skipped fill-value chunks on purpose; refused by default)",
    )
    convert.add_argument(
        "--spatial-chunks",
        nargs="+",
        metavar="AXIS=LEN",
        help="also chunk each sample, for spatial ranks that read one region: AXIS counts in "
        "one input sample (0 the channels, 1 the first spatial axis), or a netCDF dimension "
        "name; e.g. 1=32",
    )
    convert.add_argument(
        "--compressor",
        choices=("zstd", "lz4", "blosc", "gzip", "none"),
        default="zstd",
        help="the chunks' codec, each with a checksum (default zstd; lz4 decodes ~2.5x "
        "faster a thread, for a GPU fit that reads GB/s of large fields)",
    )
    convert.add_argument(
        "--dtype",
        metavar="ARRAY=DTYPE,...",
        help="a zarr SRC's arrays stored narrower, each value checked (e.g. x=int16 for "
        "counts held as floats: half the bytes to read; a value that does not fit stops it)",
    )
    convert.add_argument(
        "--overwrite", action="store_true", help="replace DEST if it is an existing zarr store"
    )
    add_storage_option(convert, "SRC given as a URL (DEST is always a local path)")
    convert.set_defaults(run=_convert)

    info = commands.add_parser(
        "info",
        help="show a zarr store's arrays, chunks, compression, missing chunks and decode speed",
        description="Lists each array's shape, dtype, chunks, codecs, bytes on disk and in "
        "memory, samples, and chunks missing from the store (a quick existence check per "
        "chunk), then estimates how many samples/s one process on this machine decodes "
        "(timing a few whole chunks).",
    )
    info.add_argument("store", metavar="STORE.zarr", help="a zarr store (path or fsspec URL)")
    info.add_argument(
        "--sample-dim",
        default="0",
        metavar="DIM",
        help="the dimension that indexes samples: a name or an axis number (default 0)",
    )
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.add_argument(
        "--decode-seconds",
        type=float,
        default=0.5,
        help="time spent decoding per array for the estimate (default 0.5)",
    )
    info.add_argument("--no-decode", action="store_true", help="skip the decode estimate")
    info.add_argument(
        "--no-check", action="store_true", help="skip the missing-chunk check (slow stores)"
    )
    info.add_argument(
        "--verify",
        action="store_true",
        help="read and decode every chunk: checksums (where the store has them), finite "
        "values, per-array min/max/mean, and chunks far out of their array's range; exit "
        "status 1 naming the chunk when one fails",
    )
    info.add_argument(
        "--outlier-factor",
        type=float,
        default=1e6,
        metavar="F",
        help="with --verify: flag a chunk whose largest magnitude is F times its array's "
        "typical chunk's (default 1e6; 0: no range check)",
    )
    info.add_argument(
        "--patch",
        metavar="DIM=LEN,...",
        help="windows of this size (dataflow.io.PatchSource), e.g. lat=64,lon=64 or "
        "0=64,1=64,2=64: the chunks and bytes a window reads, and a chunking that suits it",
    )
    add_storage_option(info, "STORE given as a URL (with --verify and --patch too)")
    info.set_defaults(run=_info)

    report = commands.add_parser(
        "report",
        aliases=["plot"],  # the command's first name, kept for older instructions
        help="write the report (PNG plots, CSV) of a fit from its history.json",
        description="Writes training.png (loss and held-out metrics vs samples seen and wall "
        "time), schedule.png (global batch and LR per phase), replicas.png (batch split and "
        "samples/s per replica), step_time.png (each step's time split into data wait, "
        "compute, exposed allreduce and engine overhead), steps.csv, epochs.csv, a copy of "
        "the history and report.md (what each plot shows).",
    )
    report.add_argument("history", metavar="history.json", help="written by History.to_json")
    report.add_argument(
        "--out", metavar="DIR", help="folder for the report (default: report/ beside the history)"
    )
    report.set_defaults(run=_report)

    scale = commands.add_parser(
        "scale",
        help="predict throughput and scaling efficiency from 1 to 4,096 workers",
        description="Prints the cost model's scaling table (global batch, step time, "
        "samples/s, efficiency and each term of the step: compute, data wait, allreduce "
        "and its exposed part, engine overhead) for a preset built from published "
        "constants or a saved (calibrated) model, at a fixed local batch or over a "
        "variable-batch schedule, and draws it to a PNG. --published prints the model "
        "against published scaling results. See docs/costmodel.md.",
        epilog="examples:\n  dataflow scale --preset resnet50-h100-ndr --out scale.png\n"
        "  dataflow scale --model calibrated.json --stepwise 0:256,30:1024,60:4096\n"
        "  dataflow scale --published",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = scale.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        default="resnet50-h100-ndr",
        metavar="NAME",
        help="a model preset (default resnet50-h100-ndr); names: "
        "resnet50-{h100-ndr,a100-hdr,v100-edr,p100-50gbe}, resnet101-p100-25gbe, "
        "inception_v3-p100-25gbe",
    )
    source.add_argument("--model", metavar="FILE.json", help="a CostModel saved by .save()")
    batch = scale.add_mutually_exclusive_group()
    batch.add_argument("--local-batch", type=int, metavar="N", help="weak scaling at N per worker")
    batch.add_argument(
        "--stepwise", metavar="E:B,...", help="a Stepwise schedule {epoch: global batch}"
    )
    batch.add_argument(
        "--adaptive",
        metavar="INITIAL:FINAL",
        help="a batch doubling each phase from INITIAL to FINAL (global batches)",
    )
    scale.add_argument(
        "--epochs", type=int, default=90, help="epochs to train, the schedule's length (default 90)"
    )
    scale.add_argument(
        "--samples-per-epoch",
        type=int,
        metavar="N",
        help="the dataset's size, for the time to train (default: the one a calibrated model "
        "was measured on, else ImageNet's 1,281,167)",
    )
    scale.add_argument(
        "--network",
        metavar="NAME",
        help="the link between nodes (an interconnect preset, e.g. ib-hdr): needed to "
        "predict a model calibrated on one node beyond that node",
    )
    scale.add_argument("--per-node", type=int, metavar="N", help="workers per node with --network")
    scale.add_argument("--max-workers", type=int, default=4096, help="default 4096")
    scale.add_argument("--out", metavar="FILE.png", help="write the scaling figure")
    scale.add_argument(
        "--published", action="store_true", help="print the published-results reproduction"
    )
    scale.set_defaults(run=_scale)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except DataflowError as exc:
        shown = hide_secrets(str(exc), getattr(args, "storage_options", None))
        print(f"dataflow: error: {shown}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
