"""Pipeline problems: stages placed on devices, each micro-batch running every stage's forward
then every stage's backward in reverse.

For stages ``0..S-1`` and micro-batches ``0..m-1`` the blocks are ``F{s}.{i}`` and ``B{s}.{i}``
with dependencies ``F{s-1}.{i} -> F{s}.{i}``, ``F{S-1}.{i} -> B{S-1}.{i}`` and
``B{s+1}.{i} -> B{s}.{i}``; ``F{s}.{i}`` allocates ``act[s]`` on each of its devices and
``B{s}.{i}`` frees it. A stage may span several devices (tensor-parallel, as the shared embedding
of Tessel's M-shape); then its blocks occupy all of them at once.

Placements (``stage_devices[s]`` is stage ``s``'s device or tuple of devices):

- :func:`linear` ``p``: stage ``s`` on device ``s`` (what GPipe and 1F1B assume);
- :func:`loop` ``p, v``: ``v p`` stages, stage ``s`` on device ``s mod p`` (interleaved 1F1B);
- :func:`vshape` ``p``: ``2p`` stages down then up, device ``s`` for ``s < p`` else ``2p-1-s``
  (Tessel's V-shape: device 0 holds the first and the last stage);
- :func:`mshape` ``p``: a stage on all devices, ``p`` stages one per device, a stage on all
  devices again (an embedding shared by input and output, split across every device).
"""

from __future__ import annotations

from .core import Block, Problem

__all__ = ["pipeline_problem", "linear", "loop", "vshape", "mshape", "fwd", "bwd"]


def fwd(s: int, i: int) -> str:
    return f"F{s}.{i}"


def bwd(s: int, i: int) -> str:
    return f"B{s}.{i}"


def linear(p: int) -> list[int]:
    return list(range(p))


def loop(p: int, v: int) -> list[int]:
    return [s % p for s in range(v * p)]


def vshape(p: int) -> list[int]:
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def mshape(p: int) -> list:
    every = tuple(range(p))
    return [every] + list(range(p)) + [every]


def _per_stage(name: str, value, n: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name}: expected one value per stage ({n}) (got {len(value)})")
    return value


def pipeline_problem(stage_devices, *, micro_batches: int, forward=1, backward=2, activation=1.0,
                     memory_limit=None, base_memory=0.0, comm_delay=0.0) -> Problem:
    """The blocks of ``micro_batches`` micro-batches through stages placed by ``stage_devices``.

    ``forward``, ``backward`` (durations) and ``activation`` (memory a forward keeps until its
    backward) are scalars or one per stage.
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches: expected an int >= 1 (got {micro_batches!r})")
    devs = [tuple(d) if isinstance(d, (tuple, list)) else (int(d),) for d in stage_devices]
    n_stages = len(devs)
    if n_stages < 1:
        raise ValueError("stage_devices: expected at least one stage (got none)")
    f = _per_stage("forward", forward, n_stages)
    b = _per_stage("backward", backward, n_stages)
    a = _per_stage("activation", activation, n_stages)
    n_devices = max(max(d) for d in devs) + 1
    blocks = []
    for i in range(micro_batches):
        for s in range(n_stages):
            blocks.append(Block(fwd(s, i), devs[s], f[s], a[s],
                                (fwd(s - 1, i),) if s else (), "F", s, i))
        for s in reversed(range(n_stages)):
            dep = bwd(s + 1, i) if s < n_stages - 1 else fwd(s, i)
            blocks.append(Block(bwd(s, i), devs[s], b[s], -a[s], (dep,), "B", s, i))
    return Problem(tuple(blocks), n_devices, memory_limit, base_memory, comm_delay)
