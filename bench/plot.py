"""PNG plots of benchmark results (matplotlib): decode tokens/s per request and hit rate vs pool fraction per
system, plain and MTP (from bench/decode.py's JSON), prefill step time vs prompt tokens per mode (from
bench/prefill.py's markdown table).

Usage: python -m bench.plot [--decode results.json] [--prefill prefill.md] --out-dir DIR
Writes DIR/decode.png and/or DIR/prefill.png. A plot whose input file does not exist is left out with a note
(its bench step was skipped); a malformed input is an error.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PREFILL_MODES = ("resident", "host view", "page-in waves", "stage sync", "stage")
OPTIONAL_PREFILL_MODES = {"page-in waves"}  # tables written before that mode existed lack it


def markdown_rows(text: str) -> list[dict[str, str]]:
    """Rows of the first markdown table in `text`, keyed by its header cells."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def _float(v: object) -> float:
    try:
        return float(str(v).rstrip("x%"))
    except ValueError:
        return math.nan


def _tok_s_per_request(r: dict) -> float:
    """Accepted tokens/s per request (results before MTP rows carry only tok_s of the batch)."""
    if "tok_s_req" in r:
        return _float(r["tok_s_req"])
    return _float(r["tok_s"]) / int(r["bs"])


def plot_decode(results: list[dict], path: Path) -> None:
    """tokens/s per request (top row) and hit rate (bottom row) vs pool fraction, one column per batch size;
    per-layer-skew traces solid, same-skew dashed, recorded dotted; MTP rows (num_spec > 0) are their own lines
    (square markers); systems that do not depend on the pool are flat lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({int(r["bs"]) for r in results})
    traces = sorted({r["trace"] for r in results})
    systems = list(dict.fromkeys(r["system"] for r in results))
    specs = sorted({int(r.get("num_spec", 0)) for r in results})
    lines = len(systems) * len(traces) * len(specs)  # legend entries, at most; two columns below the panels
    legend_in = 0.14 * math.ceil(lines / 2) + 0.2
    fig, axes = plt.subplots(2, len(batches), figsize=(4.5 * len(batches), 7 + legend_in), squeeze=False)
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    for col, bs in enumerate(batches):
        for trace in traces:
            style = "-" if "per-layer" in trace else ":" if "recorded" in trace else "--"
            for system in systems:
                for spec in specs:
                    pts = sorted(
                        (float(r["pool"]), _tok_s_per_request(r), _float(r["hit_rate"]))
                        for r in results
                        if int(r["bs"]) == bs
                        and r["trace"] == trace
                        and r["system"] == system
                        and int(r.get("num_spec", 0)) == spec
                    )
                    if not pts:
                        continue
                    xs = [p[0] for p in pts]
                    label = f"{system}{f' MTP {spec}' if spec else ''}, {trace}"
                    for row, idx in ((0, 1), (1, 2)):
                        axes[row][col].plot(
                            xs,
                            [p[idx] for p in pts],
                            style,
                            marker="s" if spec else "o",
                            color=colors[system],
                            label=label,
                        )
        axes[0][col].set_title(f"decode bs {bs}")
        axes[0][col].set_ylabel("tokens/s per request (MoE layers)")
        axes[0][col].set_yscale("log")
        axes[1][col].set_ylabel("hit rate")
        axes[1][col].set_xlabel("pool / all experts")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=6, frameon=False)
    fig.tight_layout(rect=(0, legend_in / (7 + legend_in), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_prefill(rows: list[dict[str, str]], path: Path) -> None:
    """Prefill step ms vs tokens per mode, one panel per (shape, format, pool)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["shape"], r["format"], r["pool"]) for r in rows if _float(r["tokens"]) > 0))
    fig, axes = plt.subplots(1, max(1, len(cases)), figsize=(4.5 * max(1, len(cases)), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        sel = sorted(
            (r for r in rows if (r["shape"], r["format"], r["pool"]) == case and _float(r["tokens"]) > 0),
            key=lambda r: _float(r["tokens"]),
        )
        for mode in (m for m in PREFILL_MODES if m in sel[0]):  # older tables lack the optional modes
            ax.plot(
                [_float(r["tokens"]) for r in sel], [_float(r[mode]) for r in sel], marker="o", label=mode
            )
        ax.set_title(" ".join(case))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("step ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _input(option: str, path: str | None) -> str | None:
    """The text of one plot's input file, or None (the plot is left out, with a note) when it does not exist:
    the step that writes it was skipped or failed."""
    if path is None:
        return None
    if not Path(path).is_file():
        print(
            f"note: {option} {path} does not exist (its bench step skipped or failed?); that plot is left out"
        )
        return None
    return Path(path).read_text()


def load_decode(text: str, path: str) -> list[dict]:
    """bench/decode.py's results without the errored cases; ValueError naming `path` when malformed."""
    try:
        results = json.loads(text)["results"]
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise TypeError("results is not a list of objects")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not bench/decode.py JSON results ({type(exc).__name__}: {exc})") from exc
    return [r for r in results if not r.get("error")]


def load_prefill(text: str, path: str) -> list[dict[str, str]]:
    """bench/prefill.py's table rows; ValueError naming `path` when it has no such table."""
    rows = markdown_rows(text)
    needed = {"shape", "format", "pool", "tokens", *PREFILL_MODES} - OPTIONAL_PREFILL_MODES
    if not rows or not needed <= rows[0].keys():
        raise ValueError(
            f"{path}: no bench/prefill.py table (a markdown table with columns {sorted(needed)})"
        )
    return rows


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", help="bench/decode.py JSON results (left out with a note if missing)")
    ap.add_argument("--prefill", help="bench/prefill.py markdown results (left out with a note if missing)")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    decode = _input("--decode", args.decode)
    prefill = _input("--prefill", args.prefill)
    # Parse both before drawing either: a malformed input fails the step before any PNG is written.
    decode_results = load_decode(decode, args.decode) if decode is not None else None
    prefill_rows = load_prefill(prefill, args.prefill) if prefill is not None else None
    if decode_results == []:
        print(f"note: {args.decode} has no successful case; decode.png is left out")
    elif decode_results is not None:
        plot_decode(decode_results, out / "decode.png")
        written.append(out / "decode.png")
    if prefill_rows is not None:
        plot_prefill(prefill_rows, out / "prefill.png")
        written.append(out / "prefill.png")
    for p in written:
        print(f"wrote {p}")
    return written


if __name__ == "__main__":
    main()
