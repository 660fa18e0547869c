"""Saved models: the weights ``ngra train`` selected, with what rebuilding them needs.

A model file (``ngra train --save-model PATH``, :func:`save_model`) is a plain dict that
``torch.load(PATH, weights_only=True)`` reads (no pickled classes):

- ``format``: ``"ngra-model"``, ``version``: 1;
- ``model``: a name of ``ngra.nn.MODELS``; ``build``: the keyword arguments of
  ``ngra.nn.build_model`` (``in_dim``, ``hidden``, ``out_dim``, ``num_layers``, ``dropout``,
  ``heads``, and ``num_relations`` for rgcn);
- ``state_dict``: the weights (the epoch selected on validation, not the last one);
- ``data``: how the features were prepared (``dataset``, ``normalize_features``, ``seed``,
  ``dataset_options``), so ``ngra evaluate`` / ``ngra predict`` read the data the same way;
- ``metrics``: the run's ``train_acc``, ``val_acc``, ``test_acc``, ``best_epoch``.

So ``build_model(f["model"], **f["build"]).load_state_dict(f["state_dict"])`` gives the model
back; :func:`load_model` does that after checking the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["ModelFileError", "save_model", "load_model", "FORMAT", "VERSION"]

FORMAT = "ngra-model"
VERSION = 1


class ModelFileError(ValueError):
    """A model file is missing, damaged, of another format, or does not fit the data."""


def save_model(path, model: torch.nn.Module, *, name: str, build: dict, data: dict | None = None,
               metrics: dict | None = None) -> Path:
    """Write ``model``'s weights and how to rebuild it to ``path`` atomically (a temporary file,
    fsync, ``os.replace``). ``name`` and ``build`` are ``build_model``'s name and keyword
    arguments. Returns the path."""
    from .nn import MODELS

    path = Path(path)
    if name not in MODELS:
        raise ModelFileError(f"model {name!r} is not one of {list(MODELS)}; only models of "
                             "ngra.nn.build_model can be saved this way")
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    payload = {"format": FORMAT, "version": VERSION, "model": name, "build": dict(build),
               "state_dict": state, "data": dict(data or {}), "metrics": dict(metrics or {})}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_model(path, *, device="cpu") -> tuple[torch.nn.Module, dict]:
    """``(model, info)``: the model rebuilt with ``build_model`` and its saved weights loaded,
    in eval mode on ``device``, and the file's dict without ``state_dict``. Raises
    :class:`ModelFileError` naming the file for anything that is not a valid model file."""
    from .nn import MODELS, build_model

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {str(path)!r} not found; give the PATH written by "
                             "ngra train --save-model PATH")
    try:
        f = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise ModelFileError(f"{path}: not a readable model file ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}); write it again with ngra train "
                             "--save-model") from e
    if not isinstance(f, dict) or f.get("format") != FORMAT:
        hint = (" (a checkpoint? those resume training: ngra train --checkpoint DIR --resume)"
                if isinstance(f, dict) and "optimizer" in f else "")
        raise ModelFileError(f"{path}: not an ngra model file{hint}; write one with ngra train "
                             "--save-model PATH")
    if f.get("version") != VERSION:
        raise ModelFileError(f"{path}: model file version {f.get('version')!r}; this ngra reads "
                             f"version {VERSION}")
    name, build, state = f.get("model"), f.get("build"), f.get("state_dict")
    if name not in MODELS or not isinstance(build, dict) or not isinstance(state, dict):
        raise ModelFileError(f"{path}: damaged model file (model {name!r}, build "
                             f"{type(build).__name__}, state_dict {type(state).__name__})")
    try:
        model = build_model(name, **build)
        model.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ModelFileError(f"{path}: the saved weights do not fit model {name!r} built with "
                             f"{build}: {' '.join(str(e).split())[:300]}") from e
    info = {k: v for k, v in f.items() if k != "state_dict"}
    return model.to(device).eval(), info
