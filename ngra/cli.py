"""Command line: ``ngra train``, ``ngra evaluate``, ``ngra predict``, ``ngra info`` and ``ngra
partition`` (also ``python -m ngra``).

User errors (bad values, unknown names, missing folders, a damaged checkpoint, a run that
diverged or needs more memory than there is) print one line,
``ngra <command>: error: <what is wrong and how to fix it>``, and exit with status 2. Ctrl-C
(SIGINT) prints one line and exits with 130; the line says how to resume only when a checkpoint
was written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["main"]

_COMMANDS = ("train", "evaluate", "predict", "info", "partition")

_EXAMPLES = """examples:
  ngra train --model gcn --dataset cora --data-dir ../shared/datasets --seed 0 --metrics-json out.json
  ngra train --model gat --dataset cora --data-dir ../shared/datasets --checkpoint ckpt/ --resume
  ngra train --model gcn --dataset sbm --epochs 100
  ngra train --model gcn --dataset cora --data-dir ../shared/datasets --save-model gcn.pt
  ngra evaluate --model-file gcn.pt --data-dir ../shared/datasets
  ngra predict --model-file gcn.pt --data-dir ../shared/datasets --output pred.csv
  ngra info --dataset cora --data-dir ../shared/datasets
  ngra partition --dataset sbm --dataset-option num_nodes=100000 --out sbm100k --intervals 8
  ngra train --model gcn --dataset sbm100k --workers 4
"""


class _UsageError(Exception):
    """Raised instead of argparse's exit so main() prints one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the usage block too
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    from .datasets import available
    from .nn import MODELS
    from .train import MODEL_DEFAULTS

    p = _Parser(prog="ngra", description="ngra: GNN training with SAGA-NN vertex programs.",
                epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    defaults = "\n".join(
        f"  {name:<10} hidden {hp.hidden}{' x %d heads' % hp.heads if name == 'gat' else ''}, "
        f"dropout {hp.dropout}, lr {hp.lr}, weight decay {hp.weight_decay} ({hp.weight_decay_on} "
        f"layer{'s' if hp.weight_decay_on == 'all' else ''}), {hp.epochs} epochs, patience "
        f"{hp.patience if hp.patience is not None else 'off'}"
        for name, hp in MODEL_DEFAULTS.items())
    t = sub.add_parser(
        "train", help="train a model on a dataset (full graph, node classification)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a GNN for node classification. Hyperparameters left out take the "
                    "model's defaults (after the papers for gcn and gat):\n" + defaults,
        epilog="Ends with one line of train/val/test accuracy of the model with the best validation "
               "score; --metrics-json writes them (fractions in [0, 1]) with epoch_time_s and "
               "peak_memory_bytes (the process's peak resident memory, ru_maxrss).")
    t.add_argument("--model", required=True, metavar="NAME", help=f"one of: {', '.join(MODELS)}")
    t.add_argument("--dataset", required=True, metavar="NAME",
                   help=f"one of: {', '.join(available())}; or a folder written by ngra partition "
                        "(with several workers each reads only its piece)")
    t.add_argument("--data-dir", metavar="DIR",
                   help="folder with planetoid/, npz/, ogb/ (default: $NGRA_DATASETS or "
                        "~/.cache/ngra/datasets); not needed for sbm, karate")
    dataset_option = dict(action="append", default=[], metavar="KEY=VALUE",
                          help="argument for the dataset loader or generator, e.g. num_nodes=100000 "
                               "for sbm (repeatable; see ngra.datasets.load)")
    t.add_argument("--dataset-option", **dataset_option)
    t.add_argument("--epochs", type=int, help="maximum number of epochs")
    t.add_argument("--hidden", type=int, help="hidden width (gat: per head)")
    t.add_argument("--heads", type=int, help="attention heads (gat)")
    t.add_argument("--num-layers", type=int, help="number of graph layers")
    t.add_argument("--lr", type=float, help="Adam learning rate")
    t.add_argument("--weight-decay", type=float, help="L2 penalty")
    t.add_argument("--weight-decay-on", choices=("first", "all"),
                   help="put the L2 penalty on the first layer only (Kipf's GCN) or on all layers")
    t.add_argument("--dropout", type=float, help="dropout probability, in [0, 1)")
    t.add_argument("--patience", type=int,
                   help="stop after N epochs without improvement on validation; 0: off")
    t.add_argument("--selection", choices=("gat", "loss"),
                   help="improvement and kept weights: 'gat' (val accuracy or loss, GAT's rule) or "
                        "'loss' (val loss only, Shchur et al.)")
    t.add_argument("--seed", type=int, default=0, help="random seed (also the split seed of random-split "
                                                       "datasets) (default 0)")
    t.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default cpu)")
    norm = t.add_mutually_exclusive_group()
    norm.add_argument("--normalize-features", dest="normalize_features", action="store_const", const=True,
                      help="row-normalize the features (default: for bag-of-words datasets)")
    norm.add_argument("--raw-features", dest="normalize_features", action="store_const", const=False,
                      help="use the features as stored")
    t.add_argument("--memory-budget", metavar="SIZE",
                   help="stream the graph through ngra.Engine within this memory, e.g. 2GiB")
    t.add_argument("--num-chunks", type=int, metavar="P", help="stream the graph as P x P chunks")
    t.add_argument("--checkpoint", metavar="DIR", help="write DIR/last.pt every --checkpoint-every epochs")
    t.add_argument("--checkpoint-every", type=int, default=1, metavar="N", help="(default 1)")
    t.add_argument("--resume", action="store_true", help="continue the run checkpointed in --checkpoint DIR")
    t.add_argument("--metrics-json", metavar="FILE", help="write the final metrics (and history) as JSON")
    t.add_argument("--save-model", metavar="FILE",
                   help="write the selected weights (best validation epoch) and how to rebuild the "
                        "model, for ngra evaluate / ngra predict and torch.load(weights_only=True)")
    t.add_argument("--log-every", type=int, default=0, metavar="N",
                   help="print a line of loss and accuracy every N epochs (default 0: only the bar)")
    t.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    t.add_argument("--workers", type=int, metavar="K",
                   help="train on K local worker processes (torch's elastic launcher; under "
                        "torchrun the launcher's count is used)")
    t.add_argument("--partition", choices=("metis", "contiguous", "random"), default="metis",
                   help="how the vertices are split over the workers (default metis)")
    t.add_argument("--exchange", choices=("halo", "ring"), default="halo",
                   help="with several workers: how vertex values cross the cut: halo (the rows "
                        "each worker needs, default) or ring (NGra's chunk sharing: every "
                        "worker's rows circulate around a ring, overlapped with compute)")
    t.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="with --workers: restart the workers up to N times when one fails, as "
                        "torchrun --max-restarts does; with --checkpoint they resume from it")
    t.set_defaults(handler=_train)

    for command, text in (("evaluate", "accuracy and loss of a saved model on each split of a "
                                        "dataset"),
                          ("predict", "a saved model's predicted class for every vertex")):
        c = sub.add_parser(command, help=text, description=text[0].upper() + text[1:] + ". The "
                           "dataset is read as in training (same feature normalization and split "
                           "seed, from the model file) unless overridden.")
        c.add_argument("--model-file", required=True, metavar="FILE",
                       help="written by ngra train --save-model FILE")
        c.add_argument("--dataset", metavar="NAME", help="default: the dataset the model was "
                                                         "trained on")
        c.add_argument("--data-dir", metavar="DIR", help="as for train")
        c.add_argument("--dataset-option", **{**dataset_option, "help": "as for train (default: "
                                                                       "the training run's)"})
        c.add_argument("--device", default="cpu", help="torch device (default cpu)")
        if command == "evaluate":
            c.add_argument("--json", action="store_true", help="print the result as JSON")
            c.set_defaults(handler=_evaluate)
        else:
            c.add_argument("--output", required=True, metavar="FILE",
                           help="FILE.npy (int64 class per vertex), FILE.csv (vertex,class,"
                                "probability) or FILE.pt (the [N, classes] probabilities)")
            c.set_defaults(handler=_predict)

    i = sub.add_parser("info", help="print statistics of a dataset")
    i.add_argument("--dataset", required=True, metavar="NAME", help=f"one of: {', '.join(available())}")
    i.add_argument("--data-dir", metavar="DIR", help="as for train")
    i.add_argument("--dataset-option", **{**dataset_option, "help": "as for train, e.g. scale=16 and "
                                                                   "num_edges=1000000 for rmat"})
    i.add_argument("--json", action="store_true", help="print the statistics as JSON")
    i.set_defaults(handler=_info)

    text = ("write a dataset as a chunk store, so that each of several workers reads only its "
            "piece (then: ngra train --dataset FOLDER --workers K)")
    s = sub.add_parser("partition", help=text, description=text[0].upper() + text[1:] + ". The "
                       "vertices are ordered (METIS by default) and cut into --intervals "
                       "intervals; K workers take runs of them, so give at least as many intervals "
                       "as workers.")
    s.add_argument("--dataset", required=True, metavar="NAME", help=f"one of: {', '.join(available())}")
    s.add_argument("--data-dir", metavar="DIR", help="as for train")
    s.add_argument("--dataset-option", **{**dataset_option, "help": "as for train"})
    s.add_argument("--seed", type=int, default=0, help="split seed of random-split datasets, as "
                                                       "for train (default 0)")
    snorm = s.add_mutually_exclusive_group()
    snorm.add_argument("--normalize-features", dest="normalize_features", action="store_const",
                       const=True, help="write row-normalized features (default: as train does)")
    snorm.add_argument("--raw-features", dest="normalize_features", action="store_const",
                       const=False, help="write the features as stored")
    s.add_argument("--out", required=True, metavar="FOLDER", help="the folder to write")
    s.add_argument("--intervals", type=int, required=True, metavar="P",
                   help="vertex intervals (at least the number of workers that will train on it)")
    s.add_argument("--ordering", choices=("metis", "rcm", "identity"), default="metis",
                   help="vertex order before cutting (default metis: the intervals are METIS "
                        "parts)")
    s.add_argument("--overwrite", action="store_true", help="replace a dataset written there before")
    s.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    s.set_defaults(handler=_partition)
    return p


def _train(args) -> int:
    from .distributed.launch import worker_info
    from .train import TrainConfig, fit, record_run, setup

    try:
        info = worker_info()
    except ValueError as e:
        raise _user("train", str(e)) from e
    if args.workers is not None:
        if args.workers < 1 or args.workers > 64:
            raise _user("train", f"--workers must be between 1 and 64 (got {args.workers})")
        if info.distributed and info.world_size != args.workers:
            raise _user("train", f"--workers {args.workers} but the launcher started "
                                 f"{info.world_size} workers (WORLD_SIZE); leave --workers out "
                                 "under torchrun")
        if args.workers > 1 and not info.distributed:
            if args.max_restarts < 0:
                raise _user("train", f"--max-restarts must be >= 0 (got {args.max_restarts})")
            return _launch(args)
    if info.rank != 0:  # one voice: the other workers train quietly
        args.progress, args.log_every, args.metrics_json = False, 0, None
    if (info.restart_count and args.checkpoint and not args.resume
            and (Path(args.checkpoint) / "last.pt").is_file()):
        # The launcher restarted the group after a failure (torchrun --max-restarts): go on from
        # the checkpoint the failed attempt wrote, as a rerun with --resume would.
        args.resume = True
        if info.rank == 0:
            print(f"ngra train: restart {info.restart_count} by the launcher: resuming from "
                  f"{Path(args.checkpoint) / 'last.pt'}", file=sys.stderr, flush=True)

    config = TrainConfig(
        model=args.model, dataset=args.dataset, data_dir=args.data_dir,
        dataset_options=_options(args.dataset_option, "train"), epochs=args.epochs,
        hidden=args.hidden, heads=args.heads, num_layers=args.num_layers, dropout=args.dropout,
        lr=args.lr, weight_decay=args.weight_decay, weight_decay_on=args.weight_decay_on,
        patience=args.patience, selection=args.selection, seed=args.seed, device=args.device,
        normalize_features=args.normalize_features, checkpoint=args.checkpoint, resume=args.resume,
        checkpoint_every=args.checkpoint_every, memory_budget=args.memory_budget,
        num_chunks=args.num_chunks, progress=args.progress, log_every=args.log_every,
        partition=args.partition, exchange=args.exchange, save_model=args.save_model if info.rank == 0 else None)
    metrics_path = Path(args.metrics_json) if args.metrics_json else None
    if metrics_path is not None:
        _check_writable(metrics_path)
    if args.save_model is not None and info.rank == 0:
        _check_writable(Path(args.save_model), "--save-model")
    try:
        model, data, fit_kwargs, engine_ctx = setup(config)
    except (ValueError, TypeError, OSError) as e:
        # Everything setup() raises is about what the user gave: the settings, the dataset files.
        raise _user("train", str(e)) from e
    try:
        with engine_ctx:
            result = fit(model, data, **fit_kwargs)
    except FloatingPointError as e:  # the loss diverged: too high a learning rate, or bad features
        raise _user("train", str(e)) from e
    except ValueError as e:
        from .train import ConfigError

        if isinstance(e, ConfigError):  # e.g. a checkpoint written for other settings, or damaged
            raise _user("train", str(e)) from e
        raise
    record_run(result, config, engine_ctx)
    if info.distributed:
        from .distributed.launch import wait_for_peers

        wait_for_peers()  # every collective is done: nothing below talks to the other workers
    if info.rank != 0:
        return 0
    # The result line first: if the metrics file cannot be written after all, the run's figures
    # are still on the screen.
    print(f"{config.model} on {config.dataset}: {result.summary()}", flush=True)
    if metrics_path is not None:
        tmp = metrics_path.with_name(f".{metrics_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
            os.replace(tmp, metrics_path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _user("train", f"--metrics-json: cannot write {str(metrics_path)!r} ({e}); the run "
                                 "finished and its result is the line above") from e
    if config.save_model is not None:
        from .train import save_selected

        try:
            save_selected(result, config)
        except OSError as e:
            raise _user("train", f"--save-model: cannot write {str(config.save_model)!r} ({e}); "
                                 "the run finished and its result is the line above") from e
    return 0


def _launch(args) -> int:
    """``ngra train --workers K``: the same command on K local workers, started by torch's
    elastic launcher (each worker finds its rank in the environment)."""
    from .distributed.launch import launch

    if args.metrics_json:
        _check_writable(Path(args.metrics_json))
    if args.save_model:
        _check_writable(Path(args.save_model), "--save-model")
    try:
        launch(["train", *args.argv], args.workers, max_restarts=args.max_restarts)
    except Exception as e:  # ChildFailedError: the workers' own errors are printed above
        raise _user("train", f"a worker failed ({_failure(e)}); see its error above") from e
    return 0


def _failure(e: Exception) -> str:
    """Which workers failed and how, from the launcher's ChildFailedError (its message is a
    banner of '=' characters followed by a table)."""
    import signal

    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        lines = [line for line in str(e).splitlines() if line.strip(" =")]
        return lines[0].strip() if lines else type(e).__name__
    # The launcher stops the other workers with SIGTERM once one fails: name the ones that
    # failed on their own.
    own = {r: f for r, f in failures.items() if getattr(f, "exitcode", None) != -signal.SIGTERM}
    out = []
    for rank in sorted(own or failures):
        code = getattr(failures[rank], "exitcode", None)
        if isinstance(code, int) and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        out.append(f"worker {rank}: {how}")
    if own and len(own) < len(failures):
        out.append("the others were stopped")
    return "; ".join(out)


def _check_writable(path: Path, flag: str = "--metrics-json", command: str = "train") -> None:
    from .train import ConfigError, check_writable

    try:
        check_writable(path, flag)
    except ConfigError as e:
        raise _user(command, str(e)) from e


def _options(items: list[str], command: str) -> dict | None:
    """``["num_nodes=1000", "homophily=0.9", "features=degree"]`` -> a dict of int/float/str."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise _user(command, f"--dataset-option expects KEY=VALUE (got {item!r}), e.g. "
                                 "--dataset-option num_nodes=100000")
        for convert in (int, float):
            try:
                out[key] = convert(text)
                break
            except ValueError:
                continue
        else:
            out[key] = text
    return out or None


def _info(args) -> int:
    from .train import load_dataset

    try:
        # The same loading path as training; raw features, so the numbers describe the files.
        data = load_dataset(args.dataset, args.data_dir, normalize_features=False,
                            options=_options(args.dataset_option, "info"))
    except (ValueError, TypeError, OSError) as e:
        raise _user("info", str(e)) from e
    stats = data.stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    width = max(len(k) for k in stats)
    for k, v in stats.items():
        if isinstance(v, float):
            v = f"{v:.3f}"
        print(f"{k:<{width}}  {v}")
    return 0


def _partition(args) -> int:
    from .datasets.stored import is_stored, write_stored
    from .train import _ROW_NORMALIZED, load_dataset

    if is_stored(args.dataset):
        raise _user("partition", f"{args.dataset!r} is already a stored dataset; give the name "
                                 "of the dataset it was written from")
    if args.intervals < 1:
        raise _user("partition", f"--intervals must be >= 1 (got {args.intervals})")
    normalized = args.normalize_features
    if normalized is None:
        normalized = args.dataset.lower() in _ROW_NORMALIZED
    try:
        data = load_dataset(args.dataset, args.data_dir, seed=args.seed,
                            normalize_features=normalized,
                            options=_options(args.dataset_option, "partition"))
        if data.x is None or data.y is None:
            raise ValueError(f"dataset {args.dataset!r} has no features or labels, so it cannot "
                             "be trained on; write a labelled dataset such as sbm")
        if args.intervals > data.num_nodes:
            raise ValueError(f"--intervals {args.intervals} is more than the {data.num_nodes} "
                             "vertices; give fewer")
        stored = write_stored(data, args.out, num_intervals=args.intervals,
                              ordering=args.ordering, normalized=normalized,
                              overwrite=args.overwrite, progress=args.progress)
    except (ValueError, TypeError, OSError) as e:
        raise _user("partition", str(e)) from e
    counts = stored.store.counts.sum(0)
    print(f"wrote {args.out}: {stored.num_nodes} vertices, {stored.num_edges} edges in "
          f"{args.intervals} intervals ({args.ordering} order; in-edges per interval "
          f"{int(counts.min())}..{int(counts.max())}); train on it with: ngra train --dataset "
          f"{args.out} --model gcn --workers K (K <= {args.intervals})")
    return 0


def _saved(args):
    """The saved model and the dataset to run it on: ``(model, data, forward_kwargs, info)``."""
    from .modelfile import ModelFileError, load_model
    from .train import ConfigError, _device, load_dataset, model_inputs

    try:
        device = _device(args.device)
        model, info = load_model(args.model_file, device=device)
        saved = info.get("data") or {}
        name = args.dataset or saved.get("dataset")
        if not name:
            raise ConfigError("the model file does not say which dataset it was trained on; pass "
                              "--dataset NAME")
        # The training run's loader options, with the ones given here on top.
        options = {**(saved.get("dataset_options") or {}),
                   **(_options(args.dataset_option, args.command) or {})} or None
        data = load_dataset(name, args.data_dir, seed=saved.get("seed") or 0,
                            normalize_features=saved.get("normalize_features"), options=options)
    except (ModelFileError, ValueError, TypeError, OSError) as e:
        raise _user(args.command, str(e)) from e
    build = info["build"]
    if data.x is None:
        raise _user(args.command, f"dataset {name!r} has no vertex features; the model needs "
                                  f"[N, {build['in_dim']}] features")
    if data.num_features != build["in_dim"]:
        raise _user(args.command, f"dataset {name!r} has {data.num_features} features per vertex but "
                                  f"the model was built for {build['in_dim']}; pass the --dataset "
                                  f"it was trained on ({saved.get('dataset')!r})")
    kwargs = {k: v.to(device) for k, v in model_inputs(info["model"], data.graph).items()}
    return model, data, kwargs, info


def _evaluate(args) -> int:
    from .train import evaluate

    model, data, kwargs, info = _saved(args)
    if data.y is None:
        raise _user("evaluate", f"dataset {args.dataset or info['data'].get('dataset')!r} has no "
                                "labels; use ngra predict")
    res = evaluate(model, data, forward_kwargs=kwargs)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    for k, v in res.items():
        print(f"{k:<10}  {'n/a' if v is None else f'{v:.4f}'}")
    return 0


def _predict(args) -> int:
    import numpy as np
    import torch

    out_path = Path(args.output)
    kinds = (".npy", ".csv", ".pt")
    if out_path.suffix not in kinds:
        raise _user("predict", f"--output {str(out_path)!r} must end in one of {', '.join(kinds)}")
    _check_writable(out_path, "--output", "predict")
    model, data, kwargs, _ = _saved(args)
    device = next(model.parameters()).device
    with torch.no_grad():
        prob = model(data.graph.to(device), data.x.to(device), **kwargs).softmax(-1).cpu()
    conf, cls = prob.max(-1)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        if out_path.suffix == ".npy":
            with open(tmp, "wb") as f:
                np.save(f, cls.numpy())
        elif out_path.suffix == ".pt":
            torch.save(prob, tmp)
        else:
            with open(tmp, "w") as f:
                f.write("vertex,class,probability\n")
                f.writelines(f"{i},{c},{p:.6f}\n" for i, (c, p) in
                             enumerate(zip(cls.tolist(), conf.tolist())))
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"predicted {cls.numel()} vertices -> {out_path}")
    return 0


def _user(command: str, message: str) -> _UsageError:
    return _UsageError(f"ngra {command}: error: {message}")


def _interrupted(argv: list[str], args) -> str:
    command = getattr(args, "command", None) or next((a for a in argv if a in _COMMANDS), "")
    line = f"ngra {command}: interrupted".replace("  ", " ")
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is None:
        return line
    from .train import CHECKPOINT_NAME

    # Without --resume an existing checkpoint is refused before training starts, so one that is
    # there now was written (or resumed from) by this run.
    if (Path(checkpoint) / CHECKPOINT_NAME).is_file():
        return (f"{line}; to continue from the last checkpoint, run the same command with --resume "
                f"(it is in {checkpoint})")
    return f"{line} before the first checkpoint was written; nothing to resume"


def _out_of_memory(e: BaseException) -> bool:
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("can't allocate memory", "not enough memory", "out of memory"))


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    In a worker of a launched group it ends the process with ``os._exit`` instead of returning,
    without tearing the process group down: torch's gloo backend can deadlock or abort doing
    that at exit (see :func:`ngra.distributed.launch.wait_for_peers`), and after an error the
    peers may be gone."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of our output went away (`ngra info ... | head -1`): not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141  # 128 + SIGPIPE, what a shell reports for a command killed by it
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        args = _parser().parse_args(argv)
        args.argv = argv[argv.index("train") + 1:] if "train" in argv else argv
        return args.handler(args)
    except _UsageError as e:
        print(" ".join(str(e).split("\n")), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_interrupted(argv, args), file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        command = getattr(args, "command", "")
        print(f"ngra {command}: error: out of memory ({' '.join(str(e).split())[:300] or type(e).__name__}); "
              "the dataset or model is too large for this machine: choose smaller dataset options "
              "(--dataset-option) or model sizes (--hidden, --num-layers)", file=sys.stderr)
        return 2
