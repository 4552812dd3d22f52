"""Summaries of the benchmark records: medians, ratios, tables and the figure."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from methods import BASELINE, METHODS

#: Memory ratios are left out below this baseline (MiB): too small to divide by.
MIN_MEMORY_MIB = 1.0
#: The method the "vs ViViT 1.0" columns compare.
LIBRARY, PEER = "vivit", "vivit-1.0"


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (problem, N, method) over all rounds.

    Times: median of every timed call of every round. Ratios to the baseline: the
    median over rounds of (this method's median / the baseline's median in the
    same round): rounds run interleaved, so both saw similar machine load.

    Args:
        records: One record per worker process (see ``eigenpairs.run_case``).

    Returns:
        Summaries in the order cases first appear.
    """
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["problem"], r["batch_size"], r["method"])].append(r)
    baseline_by_round = {
        (r["problem"], r["batch_size"], r["round"]): r
        for r in records
        if r["method"] == BASELINE and r.get("status") == "ok"
    }
    summaries = []
    for (problem, batch_size, method), rs in groups.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        summary: dict[str, Any] = {
            "problem": problem,
            "batch_size": batch_size,
            "method": method,
            "rounds": len(rs),
            "rounds_ok": len(ok),
        }
        if not ok:
            summary["status"] = rs[-1].get("status", "failed")
            summaries.append(summary)
            continue
        times = [t for r in ok for t in r["times_s"]]
        cpu_times = [t for r in ok for t in r.get("cpu_times_s", [])]
        time_ratios, cpu_ratios, memory_ratios = [], [], []
        product_ratios, cpu_product_ratios = [], []
        for r in ok:
            base = baseline_by_round.get((problem, batch_size, r["round"]))
            if base is None:
                continue
            time_ratios.append(r["median_time_s"] / base["median_time_s"])
            if r.get("median_cpu_s") and base.get("median_cpu_s"):
                cpu_ratios.append(r["median_cpu_s"] / base["median_cpu_s"])
            if (base["peak_mib"] or 0) > MIN_MEMORY_MIB and r["peak_mib"] is not None:
                memory_ratios.append(r["peak_mib"] / base["peak_mib"])
            if r.get("products"):
                product_ratios.append(time_ratios[-1] / r["products"])
                if r.get("median_cpu_s") and base.get("median_cpu_s"):
                    cpu_product_ratios.append(cpu_ratios[-1] / r["products"])
        evals = ok[-1].get("top_eigenvalues")
        products = _median([r.get("products") for r in ok])
        summary.update(
            status="ok",
            median_time_s=statistics.median(times),
            min_time_s=min(times),
            max_time_s=max(times),
            time_ratio=_median(time_ratios),
            median_cpu_s=_median(cpu_times),
            cpu_ratio=_median(cpu_ratios),
            peak_mib=_median([r["peak_mib"] for r in ok]),
            memory_ratio=_median(memory_ratios),
            top_eigenvalue=max(evals) if evals else None,
            other_cpu_cores=_median([r.get("other_cpu_cores") for r in ok]),
            products=products,
            product_operator=ok[-1].get("product_operator"),
            s_per_product=statistics.median(times) / products if products else None,
            product_ratio=_median(product_ratios),
            cpu_product_ratio=_median(cpu_product_ratios),
        )
        summaries.append(summary)
    return summaries


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _products(s: dict[str, Any]) -> str:
    """Products and their operator, e.g. ``61 (GGN)``; ``–`` without a count."""
    if not s.get("products"):
        return "–"
    operator = s.get("product_operator")
    return f"{s['products']:g}" + (f" ({operator})" if operator else "")


def format_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown table: one row per (problem, N, method).

    The product columns divide the whole median time (construction included) by
    the operator products the method counted.
    """
    lines = [
        "| problem | N | method | median time [s] | min–max [s] | × f+b "
        "| CPU time [s] | × f+b | peak memory [MiB] | × f+b | top eigenvalue "
        "| others' load [cores] | products | time / product [s] | × f+b "
        "| CPU time / product × f+b |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|",
    ]
    for s in summaries:
        head = f"| {s['problem']} | {s['batch_size']} | {s['method']} "
        if s["status"] != "ok":
            lines.append(head + f"| {s['status']} |" + " |" * 12)
            continue
        lines.append(
            head
            + f"| {s['median_time_s']:.4f} "
            + f"| {s['min_time_s']:.4f}–{s['max_time_s']:.4f} "
            + f"| {_fmt(s['time_ratio'], '.1f')} "
            + f"| {_fmt(s['median_cpu_s'], '.4f')} "
            + f"| {_fmt(s['cpu_ratio'], '.1f')} "
            + f"| {_fmt(s['peak_mib'], '.1f')} "
            + f"| {_fmt(s['memory_ratio'], '.1f')} "
            + f"| {_fmt(s['top_eigenvalue'], '.6g')} "
            + f"| {_fmt(s['other_cpu_cores'], '.2f')} "
            + f"| {_products(s)} "
            + f"| {_fmt(s.get('s_per_product'), '.3g')} "
            + f"| {_fmt(s.get('product_ratio'), '.2f')} "
            + f"| {_fmt(s.get('cpu_product_ratio'), '.2f')} |"
        )
    return "\n".join(lines)


def format_comparison(
    summaries: list[dict[str, Any]], records: list[dict[str, Any]]
) -> str:
    """Markdown table of this library against ViViT 1.0, per (problem, N).

    The ratios are medians over rounds of same-round ratios.
    """
    by_round: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        if r.get("status") == "ok":
            by_round[(r["problem"], r["batch_size"], r["round"])][r["method"]] = r
    cases = list(dict.fromkeys((s["problem"], s["batch_size"]) for s in summaries))
    index = {(s["problem"], s["batch_size"], s["method"]): s for s in summaries}
    lines = [
        f"| problem | N | f+b [s] | {LIBRARY} [s] (× f+b) | {PEER} [s] "
        f"| time {LIBRARY} / {PEER} | CPU time {LIBRARY} × f+b | CPU time "
        f"{LIBRARY} / {PEER} | peak {LIBRARY} / {PEER} | vivit-mc1 × f+b "
        "(CPU) | curvlinops-eigsh [s] |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(method: str, key: str, spec: str) -> str:
        s = index.get((*case, method))
        return "–" if s is None or s["status"] != "ok" else _fmt(s[key], spec)

    for case in cases:
        time_ratios, cpu_ratios, memory_ratios = [], [], []
        for (problem, n, _), methods in by_round.items():
            if (problem, n) != case or LIBRARY not in methods or PEER not in methods:
                continue
            ours, peer = methods[LIBRARY], methods[PEER]
            time_ratios.append(ours["median_time_s"] / peer["median_time_s"])
            if ours.get("median_cpu_s") and peer.get("median_cpu_s"):
                cpu_ratios.append(ours["median_cpu_s"] / peer["median_cpu_s"])
            if peer["peak_mib"] and ours["peak_mib"] is not None:
                memory_ratios.append(ours["peak_mib"] / peer["peak_mib"])
        lines.append(
            f"| {case[0]} | {case[1]} | {cell(BASELINE, 'median_time_s', '.4f')} "
            f"| {cell(LIBRARY, 'median_time_s', '.3f')} "
            f"({cell(LIBRARY, 'time_ratio', '.1f')}×) "
            f"| {cell(PEER, 'median_time_s', '.3f')} "
            f"| {_fmt(_median(time_ratios), '.2f')} "
            f"| {cell(LIBRARY, 'cpu_ratio', '.1f')} "
            f"| {_fmt(_median(cpu_ratios), '.2f')} "
            f"| {_fmt(_median(memory_ratios), '.2f')} "
            f"| {cell('vivit-mc1', 'cpu_ratio', '.1f')} "
            f"| {cell('curvlinops-eigsh', 'median_time_s', '.3f')} |"
        )
    return "\n".join(lines)


def eigenvalue_agreement(summaries: list[dict[str, Any]]) -> list[str]:
    """Relative deviation of each exact method's top eigenvalue from this library's.

    The reference is :data:`LIBRARY`, or where it did not run the first exact
    method of this library that did (e.g. ``vivit-implicit``).
    """

    def exact(s: dict[str, Any]) -> bool:
        method = METHODS.get(s["method"])
        return method is not None and method.exact and bool(s.get("top_eigenvalue"))

    lines = []
    reference: dict[tuple, dict[str, Any]] = {}
    for s in summaries:
        case = (s["problem"], s["batch_size"])
        ours = exact(s) and METHODS[s["method"]].env == "main"
        if ours and (s["method"] == LIBRARY or case not in reference):
            reference[case] = s
    for s in summaries:
        ref = reference.get((s["problem"], s["batch_size"]))
        if ref is None or s is ref or not exact(s):
            continue
        value = ref["top_eigenvalue"]
        deviation = abs(s["top_eigenvalue"] - value) / abs(value)
        lines.append(
            f"{s['problem']} N={s['batch_size']}: {s['method']}: top eigenvalue "
            f"{s['top_eigenvalue']:.6g} vs {ref['method']} {value:.6g}, relative "
            f"deviation {deviation:.1e}"
        )
    return lines


def legend() -> str:
    """Markdown list of the methods and what they compute."""
    return "\n".join(f"- `{name}`: {m.description}" for name, m in METHODS.items())


def plot(summaries: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Time and peak memory against N, log-log, one line per method, per problem.

    Args:
        summaries: Output of :func:`summarize`.
        path: PNG file to write.
        title: Figure title.

    Returns:
        Whether the figure was written (``False`` without matplotlib).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    problems = list(dict.fromkeys(s["problem"] for s in summaries))
    fig, axes = plt.subplots(
        len(problems), 2, figsize=(10, 3.6 * len(problems)), squeeze=False
    )
    for row, problem in zip(axes, problems, strict=True):
        for method in METHODS:
            points = sorted(
                (s["batch_size"], s["median_time_s"], s["peak_mib"])
                for s in summaries
                if s["problem"] == problem
                and s["method"] == method
                and s["status"] == "ok"
            )
            if not points:
                continue
            n = [p[0] for p in points]
            row[0].plot(n, [p[1] for p in points], marker="o", label=method)
            memory = [(p[0], p[2]) for p in points if p[2] and p[2] > 0]
            if memory:
                row[1].plot(*zip(*memory, strict=True), marker="o", label=method)
        for ax, ylabel in zip(
            row, ["median time [s]", "peak memory [MiB]"], strict=True
        ):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size N")
            ax.set_ylabel(ylabel)
            ax.set_title(problem)
            ax.grid(True, which="both", alpha=0.3)
        row[1].legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
