"""A readable account of a plan: steps, groups, bytes per rank, estimated cost."""
from __future__ import annotations


def format_plan(plan) -> str:
    from .plan import max_local_bytes, step_cost
    src, dst = plan.src, plan.dst
    lines = [f"boxing {tuple(src.shape)} {src.placement} {src.sbp}",
             f"    -> {dst.placement} {dst.sbp}",
             f"route: {plan.route}, {len(plan.steps)} step(s), "
             f"estimated {plan.cost * 1e3:.3f} ms"]
    if not plan.steps:
        lines.append("  (nothing to do: layouts are equal)")
    for i, step in enumerate(plan.steps, 1):
        lines.append(f"  {i}. {step}")
        detail = getattr(step, "detail", None)
        if detail is not None:
            lines.extend("       " + d for d in detail())
            continue
        groups = step.src.placement.groups(step.axis)
        shown = ", ".join(str(list(g)) for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
        lines.append(f"       groups: {shown}")
        lines.append(f"       local bytes per rank: "
                     f"{max_local_bytes(step.src, plan.itemsize)} -> "
                     f"{max_local_bytes(step.dst, plan.itemsize)}, "
                     f"est. {step_cost(step, plan.itemsize) * 1e3:.3f} ms")
    return "\n".join(lines)
