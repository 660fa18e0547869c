"""AdamA vs Adam + gradient accumulation: peak memory, throughput, loss curves, largest model.

    .venv/bin/python benchmarks/adama.py                # char GPT + GCN, N = 1, 4, 8 (minutes)
    .venv/bin/python benchmarks/adama.py --quick        # tiny sizes, a smoke run
    .venv/bin/python benchmarks/adama.py --plot adama.png
    .venv/bin/python benchmarks/adama.py --tasks gpt --micro 8 --steps 300 \
        --sweep 3.75e-4,7.5e-4,1.5e-3,3e-3,6e-3,1.2e-2 --seeds 0,1,2   # each at its best lr

Two tasks, each trained with the same global batch split into N micro-batches (N = ``--micro``,
default 1, 4, 8), with ``torch.optim.Adam`` + gradient accumulation (``(loss / N).backward()``
N times, then ``step()``; the single-tensor Adam, ``foreach=False``, as on the CPU by default)
and with ``ngra.optim.AdamA`` (the same loop inside ``opt.micro_batches(N)``), with each form of
its second moment (``adama-mean``: ``second_moment="mean"``; ``adama-sum``: ``"sum"``, see
``ngra/optim/adama.py``; both hold the same buffers, so their memory is measured once):

- ``gpt``: ``ngra.nn.transformer.GPT`` on Tiny Shakespeare characters (``--data-dir``), a global
  batch of ``--batch`` sequences of ``--block`` tokens;
- ``gcn``: ``ngra.nn.build_model("gcn")`` on Cora (an SBM graph if Cora is not found, or with
  ``--quick``), full-graph forward per micro-batch (dropout 0.5 on every layer's input), each
  micro-batch's loss on 1/N of the training vertices, ``--gcn-steps`` steps.

Measured, side by side in one run:

- **peak memory** of live tensors of a training run (model built, two steps): on the CPU with a
  ``TorchDispatchMode`` tracker (``ngra.engine.TensorMemory``: every storage a torch op creates
  while it is active counts from its creation until freed; parameters, gradients, optimizer
  state, activations, autograd buffers), with ``torch.cuda.max_memory_allocated`` on a GPU;
- **throughput**: every configuration of a task trains at once, one step each in turn, so that
  load from other work on the machine falls on all alike; the median step time after the first;
- **loss curves**: each step's training loss (the sum of its micro-batches' scaled losses), same
  initial weights and batches for every configuration, and a validation loss at the end;
- **largest model under a memory limit** (gpt only): the widest GPT (``d_model`` a multiple of
  ``n_head`` between ``--d-model`` and ``--max-width``, found by bisection) whose peak at
  N = max(``--micro``) stays under ``--limit-mib`` (default: Adam + accumulation's peak at
  ``--d-model``, so Adam's answer is about the base width and the question is how much wider
  AdamA goes).

With ``--sweep LR,LR,...`` the script measures convergence only, at the one N of ``--micro``: every
method is trained at every learning rate with the first of ``--seeds`` (same initial weights and
batches for all), then at its best learning rate (lowest final validation loss) with the other
seeds; it prints the validation loss per method and learning rate, each method's best with its
mean and spread over the seeds, and the best-vs-best differences (per seed, paired: same weights
and batches). AdamA's two forms and Adam + accumulation take steps of different sizes at the same
learning rate (``ngra/optim/adama.py``), so comparing them at one learning rate tuned for Adam
measures mostly the step size; best against best is the fair comparison. It also prints, for Adam
+ accumulation at its best learning rate (first seed), at the start and at the end, how much
larger AdamA's v increment is than Adam's, ``N sum_i g_i^2 / (sum_i g_i)^2`` per element (1
where the micro-batch gradients agree, about N where their noise dominates).

Only the ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the kernels package: never import from this folder.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent] + [
    str(Path(__file__).resolve().parent.parent)]  # the repo, for a checkout without an install

import ngra  # noqa: E402  (before torch: OpenMP's wait policy)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ngra.optim import AdamA  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# AdamA with each form of the second moment (ngra.optim.adama): "mean" folds N sum g_i^2, "sum"
# (the paper's literal sum of the scaled micro-batch gradients' squares) sum g_i^2.
METHODS = ("adam+acc", "adama-mean", "adama-sum")
MIB = 2**20


# -- tasks ------------------------------------------------------------------------------------

class GPTTask:
    name = "gpt"

    def __init__(self, args, d_model=None):
        from ngra.datasets.corpus import load_corpus

        self.args = args
        self.corpus = load_corpus(root=args.data_dir)
        self.d_model = d_model or args.d_model

    def model(self):
        from ngra.nn.transformer import GPT

        a = self.args
        return GPT(self.corpus.vocab_size, a.block, d_model=self.d_model, n_layer=a.n_layer,
                   n_head=a.n_head)

    def batches(self, seed):
        """An endless stream of global batches (x, y), the same for every configuration."""
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield self.corpus.batch("train", self.args.batch, self.args.block, gen)

    def micro_losses(self, model, batch, n):
        x, y = (t.to(self.args.device) for t in batch)
        for xs, ys in zip(x.chunk(n), y.chunk(n)):
            yield model(xs, ys)[1]

    def val_loss(self, model):
        gen = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            batches = [self.corpus.batch("val", self.args.batch, self.args.block, gen)
                       for _ in range(4)]
            return statistics.fmean(model(x.to(self.args.device), y.to(self.args.device))[1]
                                    .item() for x, y in batches)

    def units(self, n_steps):
        return n_steps * self.args.batch * self.args.block, "tokens/s"


class GCNTask:
    name = "gcn"

    def __init__(self, args):
        self.args = args
        ds = None
        if not args.quick:
            try:
                ds = ngra.datasets.load("cora", root=args.data_dir, normalize_features=True)
            except (FileNotFoundError, OSError, ValueError) as e:
                print(f"gcn: Cora not loaded ({e}); an SBM graph instead")
        if ds is None:
            ds = ngra.datasets.load("sbm", num_nodes=600 if args.quick else 2000)
        self.ds = ds
        self.train = ds.train_mask.nonzero().flatten()
        self.num_classes = int(ds.y.max()) + 1

    def model(self):
        return ngra.nn.build_model("gcn", self.ds.x.shape[1], self.args.gcn_hidden,
                                   self.num_classes, dropout=0.5)

    def batches(self, seed):
        gen = torch.Generator().manual_seed(seed)
        while True:  # the training vertices in a fresh order each step
            yield self.train[torch.randperm(len(self.train), generator=gen)]

    def micro_losses(self, model, order, n):
        for idx in order.chunk(n):
            out = model(self.ds.graph, self.ds.x)
            yield F.cross_entropy(out[idx], self.ds.y[idx])

    def val_loss(self, model):
        model.eval()
        with torch.no_grad():
            out = model(self.ds.graph, self.ds.x)
        model.train()
        return F.cross_entropy(out[self.ds.val_mask], self.ds.y[self.ds.val_mask]).item()

    def units(self, n_steps):
        return n_steps, "steps/s"


# -- one configuration ------------------------------------------------------------------------

class Run:
    """A model, its optimizer and its batch stream; ``step()`` trains one global batch."""

    def __init__(self, task, method, n, seed, lr):
        torch.manual_seed(seed)
        self.task, self.method, self.n = task, method, n
        self.model = task.model()
        self.model.train()
        if method.startswith("adama"):
            self.opt = AdamA(self.model.parameters(), lr=lr, second_moment=method[6:])
        else:
            self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, foreach=False)
        self.data = task.batches(seed + 1)
        self.losses, self.times = [], []
        # Its own random stream (dropout): configurations trained in turns draw the same masks.
        self.rng = torch.Generator().manual_seed(seed + 2).get_state()

    def step(self):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            self._step()
            self.rng = torch.get_rng_state()

    def _step(self):
        t = time.perf_counter()
        batch = next(self.data)
        total = 0.0
        self.opt.zero_grad(set_to_none=True)
        block = (self.opt.micro_batches(self.n) if self.method.startswith("adama")
                 else contextlib.nullcontext())
        with block:
            for loss in self.task.micro_losses(self.model, batch, self.n):
                loss = loss / self.n
                loss.backward()
                total += loss.item()
        self.opt.step()
        self.times.append(time.perf_counter() - t)
        self.losses.append(total)


def peak_bytes(task, method, n, seed, lr, device, steps=2) -> int:
    """Peak live tensor bytes of building the model and training ``steps`` steps."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.device(device):
            run = Run(task, method, n, seed, lr)
            for _ in range(steps):
                run.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from ngra.engine import TensorMemory

    with TensorMemory() as tm:
        run = Run(task, method, n, seed, lr)
        for _ in range(steps):
            run.step()
        del run
    return tm.peak


# -- main -------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="gpt,gcn", help="comma-separated: gpt, gcn")
    ap.add_argument("--micro", default="1,4,8", help="numbers of micro-batches N")
    ap.add_argument("--steps", type=int, default=120, help="training steps of the gpt task")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="sequences per global batch (gpt)")
    ap.add_argument("--gcn-hidden", type=int, default=256)
    ap.add_argument("--gcn-steps", type=int, default=30, help="training steps of the gcn task")
    ap.add_argument("--max-width", type=int, default=None,
                    help="widest GPT d_model of the largest-model search (default 2 * --d-model; "
                         "0 skips the search)")
    ap.add_argument("--limit-mib", type=float, default=None,
                    help="memory limit for the largest-model search (default: Adam + "
                         "accumulation's peak at --d-model)")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "datasets"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu, or cuda (gpt only; peak from torch.cuda.max_memory_allocated; not "
                         "yet run on a GPU)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--plot", help="write loss curves and memory bars to this image file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", default=None, metavar="LR,LR,...",
                    help="learning rates: convergence only, each method at its best of them "
                         "(gpt or gcn, one N in --micro; see the module doc)")
    ap.add_argument("--seeds", default="0,1,2",
                    help="--sweep: seeds (the first for the sweep, all at each best lr)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.d_model, args.n_layer, args.block, args.batch = 4, 32, 1, 16, 8
        args.gcn_hidden, args.gcn_steps = 16, 3
    if args.max_width is None:
        args.max_width = 2 * args.d_model
    micro = [int(k) for k in args.micro.split(",") if k]
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(tasks) - {"gpt", "gcn"})
    if unknown:
        ap.error(f"--tasks: unknown {unknown}; choose from gpt, gcn")
    if any(n < 1 or args.batch % n for n in micro):
        ap.error(f"--micro: every N must be >= 1 and divide --batch {args.batch} (got {micro})")
    device = torch.device(args.device)
    if args.sweep is not None:
        try:
            lrs = [float(v) for v in args.sweep.split(",") if v]
            seeds = [int(v) for v in args.seeds.split(",") if v]
        except ValueError as e:
            ap.error(f"--sweep / --seeds: expected comma-separated numbers ({e})")
        if not lrs or not seeds or any(lr <= 0 for lr in lrs) or len(micro) != 1:
            ap.error(f"--sweep: expected learning rates > 0, at least one seed and one N in "
                     f"--micro (got {args.sweep!r}, seeds {args.seeds!r}, --micro {args.micro!r})")
        return sweep(args, tasks, lrs, seeds, micro[0], device)
    from tqdm import tqdm

    results, curves = {}, {}
    for tname in tasks:
        if tname == "gcn" and device.type != "cpu":
            print("gcn: runs on the CPU only in this benchmark (skipped on "
                  f"{device.type}); pass --tasks gpt")
            tasks = [t for t in tasks if t != "gcn"]
            continue
        task = GPTTask(args) if tname == "gpt" else GCNTask(args)
        if tname == "gcn":  # the graph's cached CSRs (forward and backward) are built here,
            Run(task, "adama-mean", 1, args.seed, args.lr).step()  # outside any measurement
        configs = [(m, n) for n in micro for m in METHODS]
        for m, n in tqdm(configs, desc=f"{tname} memory", leave=False):
            # Both AdamA forms hold the same buffers: one measurement serves both.
            if m != "adama-sum":
                peak = peak_bytes(task, m, n, args.seed, args.lr, device)
            results[tname, m, n] = {"peak": peak}
        with torch.device(device):
            runs = {(m, n): Run(task, m, n, args.seed, args.lr) for m, n in configs}
        steps = args.steps if tname == "gpt" else args.gcn_steps
        for _ in tqdm(range(steps), desc=f"{tname} training", leave=False):
            for run in runs.values():  # round-robin: load falls on all configurations alike
                run.step()
        for key, run in runs.items():
            times = run.times[1:] or run.times
            results[(tname, *key)].update(step=statistics.median(times), loss=run.losses[-1],
                                        val=task.val_loss(run.model))
            curves[(tname, *key)] = run.losses
        print_table(tname, task, results, micro, args)

    widest = None
    if "gpt" in tasks and args.max_width > 0:
        widest = largest_model(args, micro, device)
    if args.plot:
        plot(args.plot, results, curves, tasks, micro)
        print(f"wrote {args.plot}")
    return results, widest


def sweep(args, tasks, lrs, seeds, n, device):
    """Each method at each learning rate (first seed), then at its best with every seed."""
    import math

    from tqdm import tqdm

    out = {}
    for tname in tasks:
        task = GPTTask(args) if tname == "gpt" else GCNTask(args)
        steps = args.steps if tname == "gpt" else args.gcn_steps
        val = {}  # (method, lr, seed) -> final validation loss
        noise = {}  # lr -> [noise_ratio at the start, at the end] of adam+acc, first seed

        def train(m, lr, seed):
            with torch.device(device):
                run = Run(task, m, n, seed, lr)
            if m == "adam+acc" and seed == seeds[0]:
                noise[lr] = [noise_ratio(task, run.model, next(task.batches(seed + 3)), n)]
            for _ in range(steps):
                run.step()
            val[m, lr, seed] = task.val_loss(run.model)
            if m == "adam+acc" and seed == seeds[0]:
                noise[lr].append(noise_ratio(task, run.model, next(task.batches(seed + 3)), n))
            if not math.isfinite(val[m, lr, seed]):
                val[m, lr, seed] = math.inf  # diverged: never the best

        first = [(m, lr) for m in METHODS for lr in lrs]
        for m, lr in tqdm(first, desc=f"{tname} sweep (seed {seeds[0]})", leave=False):
            train(m, lr, seeds[0])
        best = {m: min(lrs, key=lambda lr: val[m, lr, seeds[0]]) for m in METHODS}
        more = [(m, best[m], s) for m in METHODS for s in seeds[1:]]
        for m, lr, s in tqdm(more, desc=f"{tname} best lr, more seeds", leave=False):
            train(m, lr, s)
        what = f" on {task.ds.name}" if tname == "gcn" else ""
        print(f"\n{tname}{what}: learning-rate sweep, N = {n}, {steps} steps, final validation "
              f"loss (seed {seeds[0]}; * = the method's best)")
        print(f"{'lr':>9} | " + " | ".join(f"{m:>10}" for m in METHODS))
        for lr in lrs:
            print(f"{lr:>9.3g} | " + " | ".join(
                f"{val[m, lr, seeds[0]]:>9.4f}{'*' if best[m] == lr else ' '}" for m in METHODS))
        print(f"each at its best lr, seeds {','.join(map(str, seeds))}:")
        stats = {}
        for m in METHODS:
            vs = [val[m, best[m], s] for s in seeds]
            mean = statistics.fmean(vs)
            sd = statistics.stdev(vs) if len(vs) > 1 else math.nan
            stats[m] = (best[m], vs, mean, sd)
            print(f"  {m:<10} lr {best[m]:<8.3g} val " + " ".join(f"{v:.4f}" for v in vs) +
                  (f"  mean {mean:.4f}, std {sd:.4f}, range {max(vs) - min(vs):.4f}"
                   if len(vs) > 1 else ""))
        ref = stats["adam+acc"]
        for when, r in zip(("start", "end"), noise[best["adam+acc"]]):
            print(f"  v increment, N sum g_i^2 / (sum g_i)^2 per element, adam+acc at its best lr, "
                  f"{when}: quartiles {r[0]:.2f} {r[1]:.2f} {r[2]:.2f}, over all elements "
                  f"{r[3]:.2f} (1: the micro-batches agree; about N = {n}: noise dominates)")
        for m in METHODS[1:]:
            diffs = [a - b for a, b in zip(stats[m][1], ref[1])]
            print(f"  {m} - adam+acc, best vs best: mean {statistics.fmean(diffs):+.4f} nats "
                  f"(per seed " + " ".join(f"{d:+.4f}" for d in diffs) + ")" +
                  (f"; adam+acc's seed std {ref[3]:.4f}" if len(seeds) > 1 else ""))
        out[tname] = {"val": {f"{m} {lr:g} {s}": v for (m, lr, s), v in val.items()},
                      "best": {m: st[0] for m, st in stats.items()}}
    return out


def noise_ratio(task, model, batch, n):
    """How much AdamA's v increment exceeds Adam + accumulation's at these weights on this batch:
    ``N sum_i g_i^2 / (sum_i g_i)^2`` per element ("mean" form; "sum" is 1/N of it), as
    quartiles over the elements and as the ratio of the sums over all elements."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(loss / n, params) for loss in task.micro_losses(model, batch, n)]
    num, den, ratios = 0.0, 0.0, []
    for j in range(len(params)):
        g = torch.stack([gi[j] for gi in grads]).double()
        s2, big = n * g.square().sum(0), g.sum(0).square()
        num, den = num + s2.sum().item(), den + big.sum().item()
        keep = big > 0
        ratios.append((s2[keep] / big[keep]).flatten())
    q = torch.quantile(torch.cat(ratios)[:2 ** 24], torch.tensor([0.25, 0.5, 0.75],
                                                                 dtype=torch.float64))
    return (*q.tolist(), num / den)


def print_table(tname, task, results, micro, args):
    what = (f"GPT d_model {args.d_model}, {args.n_layer} layers, {args.n_head} heads, batch "
            f"{args.batch} x {args.block} tokens" if tname == "gpt"
            else f"GCN hidden {args.gcn_hidden} on {task.ds.name}")
    steps = args.steps if tname == "gpt" else args.gcn_steps
    print(f"\n{tname}: {what}; {steps} steps, lr {args.lr:g}, device {args.device}")
    rate_unit = task.units(1)[1]
    print(f"{'N':>3} | {'method':<10} | {'peak MiB':>9} | {'step ms':>8} | {rate_unit:>10} | "
          f"{'train loss':>10} | {'val loss':>8}")
    for n in micro:
        for m in METHODS:
            r = results[tname, m, n]
            rate = task.units(1)[0] / r["step"]
            print(f"{n:>3} | {m:<10} | {r['peak'] / MIB:>9.2f} | {r['step'] * 1e3:>8.1f} | "
                  f"{rate:>10.1f} | {r['loss']:>10.4f} | {r['val']:>8.4f}")
    print("AdamA / Adam+accumulation, same N:")
    for n in micro:
        b = results[tname, "adam+acc", n]
        for m in METHODS[1:]:
            a = results[tname, m, n]
            print(f"  N={n} {m:<10}: peak memory {a['peak'] / b['peak']:.3f}x, throughput "
                  f"{b['step'] / a['step']:.3f}x, final val loss {a['val'] - b['val']:+.4f} nats")


def largest_model(args, micro, device):
    """The widest GPT (d_model a multiple of n_head, in [--d-model, --max-width]) whose peak
    stays under the limit, per method, by bisection (the peak grows with the width)."""
    n = max(micro)
    from tqdm import tqdm

    bar = tqdm(desc="widths", leave=False)
    peaks = {}

    def peak(m, w):
        if (m, w) not in peaks:
            peaks[m, w] = peak_bytes(GPTTask(args, d_model=w), m.replace("adama", "adama-mean"),
                                     n, args.seed, args.lr, device)
            bar.update()
        return peaks[m, w]

    limit = args.limit_mib * MIB if args.limit_mib else peak("adam+acc", args.d_model)
    widest = {}
    for m in ("adam+acc", "adama"):
        lo, hi = args.d_model // args.n_head, args.max_width // args.n_head  # in units of n_head
        if peak(m, lo * args.n_head) > limit:
            widest[m] = (None, 0)
            continue
        while lo < hi:  # invariant: lo fits
            mid = (lo + hi + 1) // 2
            if peak(m, mid * args.n_head) <= limit:
                lo = mid
            else:
                hi = mid - 1
        w = lo * args.n_head
        widest[m] = (w, GPTTask(args, d_model=w).model().num_parameters())
    bar.close()
    print(f"\nlargest GPT under {limit / MIB:.2f} MiB (N = {n}, {args.n_layer} layers, batch "
          f"{args.batch} x {args.block}; d_model a multiple of {args.n_head} in "
          f"[{args.d_model}, {args.max_width}]):")
    for m, (w, params) in widest.items():
        more = " (the widest allowed: raise --max-width)" if w == args.max_width else ""
        print(f"  {m:<9} d_model {w if w else '-'} ({params / 1e6:.3f} M parameters, peak "
              f"{peaks[m, w] / MIB if w else float('nan'):.2f} MiB){more}")
    if widest["adam+acc"][1] and widest["adama"][1]:
        print(f"  AdamA / Adam+accumulation parameters: "
              f"{widest['adama'][1] / widest['adam+acc'][1]:.3f}x")
    return widest


def plot(path, results, curves, tasks, micro):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 8), squeeze=False)
    for j, t in enumerate(tasks):
        ax = axes[0][j]
        for n in micro:
            for m, style in zip(METHODS, ("-", "--", ":")):
                ys = curves[t, m, n]
                # A running mean over 10 steps: the single-step losses are noisy.
                k = min(10, len(ys))
                smooth = [statistics.fmean(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
                ax.plot(smooth, style, label=f"{m} N={n}")
        ax.set_title(f"{t}: training loss (10-step running mean)")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        xs = range(len(micro))
        for i, m in enumerate(METHODS[:2]):
            ax.bar([x + 0.4 * i for x in xs], [results[t, m, n]["peak"] / MIB for n in micro],
                   width=0.4, label=m.replace("-mean", " (either form)"))
        ax.set_xticks([x + 0.2 for x in xs], [f"N={n}" for n in micro])
        ax.set_ylabel("peak live tensor MiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
