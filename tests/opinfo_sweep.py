"""Torch's OpInfo database swept over layouts in a simulated world: a tool for finding
silent wrong values, not part of the suite (minutes per run; needs ``pip install
expecttest`` for torch's testing modules).

Every op of ``op_db`` but the random ones, on its first float32 (``--dtype``) samples, runs with its
tensor arguments made global in several layouts (the input split on its first or last
dim, or partial; every tensor split, or partial; on a 2x2 mesh, pairs of those), and is
compared with plain torch: values, and with ``--grad`` the gradients of a weighted sum
of the outputs. One line per op: ok, MISMATCH (a wrong value: a bug) or error (an
exception: a clear one is fine), and the ops that fell back (no sbp rule).

    python tests/opinfo_sweep.py --ranks 3 --grad
    python tests/opinfo_sweep.py --ranks 4 --mesh --grad --samples 8
    python tests/opinfo_sweep.py --ops nn.functional.conv1d,matmul --ranks 4 --mesh
    python tests/opinfo_sweep.py --inplace --ranks 3      # x.add_(y) and the like
    python tests/opinfo_sweep.py --out --ranks 3          # torch.add(x, y, out=z)
    python tests/opinfo_sweep.py --plain-one --ranks 3    # one-element arguments plain
    python tests/opinfo_sweep.py --inference --ranks 3   # under torch.inference_mode()

Known reports that are not bugs: samples whose reference run changes an input in place
before the global run sees it (batch norm's running statistics), ``as_strided`` of a
view reading storage outside it, internal ops' outputs that torch leaves empty
(``native_batch_norm``'s statistics in eval), and random samples built inside an op;
with ``--out``, ``fft.ihfftn``/``ihfft2`` samples whose out= result differs from the
functional one in plain torch too, and ``linalg.matrix_rank``, whose out= overload
returns a new tensor for any tensor subclass (torch's own path for them; DTensor alike);
with ``--dtype bfloat16``, products over a split contracted dim (``bmm``, ``matmul``,
``embedding_bag``'s weighted sums), whose parts are each rounded to bfloat16 before
their sum (as DTensor's and Megatron's are), past the tolerance where values cancel;
with ``--plain-one``, ops that return a plain operand expanded (``broadcast_tensors``,
``meshgrid``), whose plain outputs the sweep's weighted sum mixes with global ones, and
batch norm's samples of one channel (the reference run wrote their running statistics).
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

import globaltensor as gt
from globaltensor.rules.registry import FallbackWarning

S, B, P = gt.sbp.split, gt.sbp.broadcast, gt.sbp.partial_sum
DTYPE = torch.float32
PLAIN_ONE = False   # --plain-one: one-element tensor arguments (not the input) stay plain
INFERENCE = False   # --inference: inputs made and ops run under torch.inference_mode()
RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "empty", "uniform",
          "exponential", "geometric", "cauchy", "poisson", "nondeterministic", "sparse",
          "lowrank", "jiterator", "item", "equal", "tolist", "histogramdd", "resize_",
          "_scaled_mm", "unique", "storage", "_segment_reduce", "rrelu")


def variants(sample, mesh: bool) -> list:
    """(name, {id(tensor): sbp}) per layout to try; tensors not named are broadcast."""
    inp = sample.input
    if not isinstance(inp, torch.Tensor) or inp.dim() == 0:
        return []
    out = [("in S0", {id(inp): S(0)})]
    if inp.dim() > 1:
        out.append(("in S-1", {id(inp): S(inp.dim() - 1)}))
    if inp.dtype != torch.bool:
        out.append(("in P", {id(inp): P}))
    leaves = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    floats = [t for t in leaves if t.dtype != torch.bool]   # (partial sums of integers too)
    if len(floats) > 1:
        out.append(("all P", {id(t): P for t in floats}))
        out.append(("in S0 others P", {id(t): S(0) if t is inp else P for t in floats}))
    if len(leaves) > 1:
        out.append(("all S0", {id(t): S(0) for t in leaves}))
        if all(t.dim() > 1 for t in leaves):
            out.append(("all S-1", {id(t): S(t.dim() - 1) for t in leaves}))
    if not mesh:
        return out
    pairs = []
    for i, (n1, m1) in enumerate(out):
        for n2, m2 in out[i + 1:] + out[:1]:
            pairs.append((f"({n1}|{n2})", {k: (m1.get(k, B), m2.get(k, B)) for k in set(m1) | set(m2)}))
    return pairs[:8]


def compare(got, want, what: str) -> None:
    gl, wl = tree_flatten(got)[0], tree_flatten(want)[0]
    if len(gl) != len(wl):
        raise AssertionError(f"{what}: {len(gl)} outputs, torch gives {len(wl)}")
    for g, w in zip(gl, wl):
        g = g.full() if isinstance(g, gt.GlobalTensor) else g
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                raise AssertionError(f"{what}: {getattr(g, 'shape', g)} {getattr(g, 'dtype', '')}, "
                                     f"torch gives {w.shape} {w.dtype}")
            # (half types: sums over ranks round in another order, a few of their ulps)
            tol = 5e-2 if w.dtype in (torch.bfloat16, torch.float16) else 1e-4
            torch.testing.assert_close(g.detach(), w.detach(), equal_nan=True, rtol=tol, atol=tol,
                                       msg=lambda m: f"{what}: {m[:300]}")
        elif g != w and w == w:
            raise AssertionError(f"{what}: {g!r}, torch gives {w!r}")


def _weighted_sum(outs: list, placement=None):
    """sum_i (out_i * w_i).sum() over the outputs that require grad, w_i fixed ramps."""
    total = None
    for o in outs:
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point():
            w = torch.linspace(-1.0, 2.0, max(o.numel(), 1))[:o.numel()].reshape(o.shape).to(o.dtype)
            if placement is not None:
                w = gt.tensor(w, placement=placement, sbp=(B,) * placement.ndim)
            total = (o * w).sum() if total is None else total + (o * w).sum()
    return total


def compare_grads(op, sample, got, global_args, placement, what: str) -> None:
    plain = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
             if isinstance(t, torch.Tensor) and t.requires_grad]
    glob = [t for t in tree_flatten(global_args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not plain or len(plain) != len(glob):
        return
    want = tree_flatten(sample.output_process_fn_grad(op.op(sample.input, *sample.args, **sample.kwargs)))[0]
    lp = _weighted_sum(want)
    lg = _weighted_sum(tree_flatten(sample.output_process_fn_grad(got))[0], placement)
    if lp is None or lg is None:
        return
    try:
        gp = torch.autograd.grad(lp, plain, allow_unused=True)
    except RuntimeError:   # not differentiable in torch either
        return
    for k, (a, b) in enumerate(zip(torch.autograd.grad(lg, glob, allow_unused=True), gp)):
        if b is None or a is None:
            if (a is None) != (b is None) and (b is None or b.any()):
                raise AssertionError(f"{what} gradient {k}: one is None")
            continue
        compare(a, b, f"{what} gradient {k}")


def _out_layouts(want: torch.Tensor, placement) -> list:
    """Layouts of an out= tensor to try: broadcast, and a split of its first dim."""
    nd = placement.ndim
    return [(B,) * nd] + ([(S(0),) + (B,) * (nd - 1)] if want.dim() else [])


def run_cases(op, cases: list, mesh: bool, grad: bool, inplace: bool = False, out: bool = False) -> list:
    """On every rank of the world: each case's result ("ok" / "MISMATCH" / "error")."""
    n = gt.get_world_size()
    placement = gt.placement("cpu", [[0, 1], [2, 3]] if mesh else list(range(n)))
    results = []
    for sample, want, name, sbps in cases:
        def to_global(t):
            if not isinstance(t, torch.Tensor):
                return t
            if PLAIN_ONE and t is not sample.input and t.numel() == 1:   # (a copy: the reference
                return t.detach().clone().requires_grad_(grad and t.requires_grad)   # wrote some)
            g = gt.tensor(t.detach(), placement=placement, sbp=sbps.get(id(t), (B,) * placement.ndim))
            return g.requires_grad_() if grad and t.requires_grad else g
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    torch.inference_mode(INFERENCE):
                warnings.simplefilter("always")
                args = tree_map(to_global, (sample.input, sample.args, sample.kwargs))
                if inplace:   # what is compared is the written input (a copy, for gradients)
                    got = args[0].clone() if grad else args[0]
                    op.inplace_variant(got, *args[1], **args[2])
                elif out:     # what is compared is the out= tensor, in each of its layouts
                    for sbp in _out_layouts(want, placement):
                        got = gt.tensor(torch.zeros_like(want), placement=placement, sbp=sbp)
                        returned = op.op(args[0], *args[1], **args[2], out=got)
                        if returned is not got:
                            raise AssertionError(f"{name}: out= {sbp}: returned another tensor")
                        compare(got, want, f"{name} out= {sbp}")
                else:
                    got = op.op(args[0], *args[1], **args[2])
                compare(got, want, name)
                if grad:
                    compare_grads(op, sample, got, args, placement, name)
            fell = {str(w.message).split(" ")[1] for w in caught if issubclass(w.category, FallbackWarning)}
            results.append(("ok", name, sorted(fell)))
        except AssertionError as e:
            results.append(("MISMATCH", name, str(e)[:400]))
        except Exception as e:
            results.append(("error", name, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
        gt.testing.reset()
    return results


def cases_of(op, samples: int, mesh: bool, grad: bool, inplace: bool = False, out: bool = False) -> list:
    cases = []
    for s in list(op.sample_inputs("cpu", DTYPE, requires_grad=grad))[:samples]:
        if s.kwargs.get("dropout_p", 0) or (s.kwargs.get("training") and "attention" in op.name):
            continue
        try:
            if inplace:
                want = s.input.clone()
                op.inplace_variant(want, *s.args, **s.kwargs)
            else:
                want = op.op(s.input, *s.args, **s.kwargs)
        except Exception:
            continue
        if out and not isinstance(want, torch.Tensor):
            continue
        if PLAIN_ONE and not any(isinstance(t, torch.Tensor) and t.numel() == 1
                                 for t in tree_flatten((s.args, s.kwargs))[0]):
            continue
        shapes = [tuple(t.shape) for t in tree_flatten((s.input, s.args))[0] if isinstance(t, torch.Tensor)]
        cases += [(s, want, f"{name} {shapes} {list(s.kwargs)}", sbps) for name, sbps in variants(s, mesh)]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mesh", action="store_true", help="a 2x2 placement (needs --ranks 4)")
    parser.add_argument("--grad", action="store_true", help="compare gradients too")
    parser.add_argument("--samples", type=int, default=4, help="samples per op")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--inplace", action="store_true",
                        help="the ops' in-place variants (x.add_(y)), comparing the written input "
                             "(with --grad, written on a copy of it)")
    parser.add_argument("--out", action="store_true",
                        help="the ops' out= variants, into a broadcast and a split out= tensor")
    parser.add_argument("--dtype", default="float32", help="the samples' dtype (int64, bfloat16, ...)")
    parser.add_argument("--plain-one", action="store_true",
                        help="keep one-element tensor arguments (but the input) plain, as a program's "
                             "scalar tensors are; only samples that have one")
    parser.add_argument("--inference", action="store_true",
                        help="make the inputs and run the ops under torch.inference_mode() (an "
                             "evaluation loop's inference tensors)")
    opts = parser.parse_args()
    global DTYPE, PLAIN_ONE, INFERENCE
    DTYPE, PLAIN_ONE, INFERENCE = getattr(torch, opts.dtype), opts.plain_one, opts.inference
    if opts.inference and opts.grad:
        parser.error("--inference runs without autograd: no --grad")
    if opts.grad and not DTYPE.is_floating_point:
        parser.error("--grad needs a floating --dtype")
    if opts.mesh and opts.ranks != 4:
        parser.error("--mesh needs --ranks 4")
    only = set(opts.ops.split(",")) if opts.ops else None
    world = gt.testing.simulated_world(opts.ranks, timeout=60)
    for op in op_db:
        if (only and op.name not in only) or (not only and any(w in op.name for w in RANDOM)) \
                or DTYPE not in op.supported_dtypes("cpu") \
                or (opts.inplace and op.inplace_variant is None) or (opts.out and not op.supports_out):
            continue
        start = time.time()
        cases = cases_of(op, opts.samples, opts.mesh, opts.grad, opts.inplace, opts.out)
        if not cases:
            continue
        try:
            results = world(run_cases, op, cases, opts.mesh, opts.grad and not opts.out, opts.inplace,
                            opts.out)[0]
        except BaseException as e:   # a rank stuck or failed outside a case: a bug too
            print(f"{op.name} {op.variant_test_name}: WORLD {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        bad = [r for r in results if r[0] == "MISMATCH"]
        errors = [r for r in results if r[0] == "error"]
        fell = sorted({f for r in results if r[0] == "ok" for f in r[2]})
        print(f"{op.name} {op.variant_test_name}: {'MISMATCH' if bad else 'error' if errors else 'ok'} "
              f"{len(results)} cases, {len(bad)} wrong, {len(errors)} raised"
              f"{' fell back: ' + ','.join(fell) if fell else ''} ({time.time() - start:.1f} s)", flush=True)
        for r in bad + errors[:2]:
            print(f"    {r[0]} {r[1]} :: {r[2]}", flush=True)


if __name__ == "__main__":
    main()
