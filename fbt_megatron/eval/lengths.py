"""Reasoning length per decoding mode: the median and mean generated tokens, and the per-problem
pairing of each mode with standard decoding (the same problem decoded both ways), so that "shorter
traces at equal or better accuracy" can be checked problem by problem, not only on the medians."""

from __future__ import annotations

import statistics


def length_stats(by_problem: dict[str, int]) -> dict:
    """``{problem: generated tokens}`` -> median, mean and count."""
    v = list(by_problem.values())
    return {"median_tokens": statistics.median(v) if v else None,
            "mean_tokens": round(statistics.fmean(v), 2) if v else None, "generations": len(v)}


def paired(standard: dict[str, int], other: dict[str, int]) -> dict | None:
    """``other`` against ``standard`` on the problems both decoded: the per-problem differences
    (other - standard) summarised — mean, median, and how many problems got shorter / equal / longer."""
    common = sorted(set(standard) & set(other))
    if not common:
        return None
    d = [other[k] - standard[k] for k in common]
    return {"problems": len(common), "mean_diff": round(statistics.fmean(d), 2), "median_diff": statistics.median(d),
            "shorter": sum(x < 0 for x in d), "equal": sum(x == 0 for x in d), "longer": sum(x > 0 for x in d)}


def pairing_table(table: dict, modes: list[str], titles: dict) -> list[str]:
    """Markdown lines: per task and non-standard mode, the pairing with standard decoding."""
    if "standard" not in modes:
        return []
    lines = ["", "Per-problem pairing with standard decoding (generated tokens, mode - standard):", "",
             "| task | mode | problems | mean diff | median diff | shorter / equal / longer |",
             "| --- | --- | --- | --- | --- | --- |"]
    rows = 0
    for task, row in table.items():
        for m in modes:
            p = (row.get(m) or {}).get("paired_with_standard")
            if m == "standard" or not p:
                continue
            rows += 1
            lines.append(f"| {task} | {titles[m]} | {p['problems']} | {p['mean_diff']:+.2f} | {p['median_diff']:+g} | "
                         f"{p['shorter']} / {p['equal']} / {p['longer']} |")
    return lines if rows else []
