"""A readable account of a plan: steps, groups, bytes per rank, estimated cost."""
from __future__ import annotations


def format_plan(plan) -> str:
    src, dst = plan.src, plan.dst
    lines = [f"boxing {tuple(src.shape)} {src.placement} {src.sbp}",
             f"    -> {dst.placement} {dst.sbp}",
             f"route: {plan.route}, {len(plan.steps)} step(s), "
             f"estimated {plan.cost * 1e3:.3f} ms"]
    if not plan.steps:
        lines.append("  (nothing to do: every rank's part stays as it is)")
    else:
        lines.append(plan.steps[0].costs.describe())
    for i, step in enumerate(plan.steps, 1):
        lines.append(f"  {i}. {step}")
        lines.extend("       " + line for line in step.describe(plan.itemsize))
    return "\n".join(lines)
