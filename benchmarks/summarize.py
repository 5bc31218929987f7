"""Markdown summary table and plots from benchmark result JSON files.

    python3 benchmarks/summarize.py                      # newest of each family in benchmarks/results
    python3 benchmarks/summarize.py FILE.json [FILE2.json ...] [--out-dir DIR] [--no-plots]
    python3 benchmarks/summarize.py --dry-run            # the newest bench_*.py --dry-run files
    python3 benchmarks/summarize.py --out-dir benchmarks/results   # regenerate the committed one

Several files are merged (e.g. one run per op, or a warm and an L2-cold run): rows of the same
(op, shape, dtype, L2 mode, provider) are pooled. Each number is the median over the passes
(forward and reversed provider order); "spread" is (max - min) / median of the pass medians,
a check that the order did not matter. Writes SUMMARY.md and PNG plots into --out-dir:
by default the --results-dir when one is named, else a folder outside the repository
(``<tmp>/loomnb-summary``), so the committed ``benchmarks/results/SUMMARY.md`` and plots are
rewritten only when ``--out-dir benchmarks/results`` (or ``--results-dir benchmarks/results``)
says so. ``--dry-run`` reads and writes ``<tmp>/loomnb-dry-run``, where ``bench_*.py
--dry-run`` writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DRY_RUN_DIR = Path(tempfile.gettempdir()) / "loomnb-dry-run"  # = _harness.DRY_RUN_DIR (no torch here)
SUMMARY_DIR = Path(tempfile.gettempdir()) / "loomnb-summary"  # default --out-dir
PROVIDER_ORDER = ["loomnb", "vllm", "torch_compile", "liger", "torch"]
SUBJECT = "loomnb"


FAMILY_PREFIXES = ("norm", "activation", "rope_cache", "decode_attention", "sampling", "spec",
                   "kv_blocks", "moe", "sampler")


def _newest_of_each(results_dir: Path, patterns=None) -> list[Path]:
    """The newest result file of each pattern (default: each family's), a real run before a
    dry run; exits if there is none at all."""
    found = []
    for pat in patterns or [f"{f}_*.json" for f in FAMILY_PREFIXES]:
        files = sorted(Path(results_dir).glob(pat), key=lambda p: ("dryrun" not in p.name, p.name))
        if files:
            found.append(files[-1])
    if not found:
        sys.exit(f"no benchmark results in {results_dir}: run a bench_<family>.py first (or --dry-run)")
    return found


def newest(results_dir: Path, pattern: str) -> Path:
    files = sorted(Path(results_dir).glob(pattern))  # names start with a sortable timestamp
    if not files:
        sys.exit(f"no {pattern} in {results_dir}: run bench_norm.py first (or --dry-run)")
    return files[-1]


def load(paths) -> tuple[list[tuple[Path, dict]], list[dict]]:
    metas, rows = [], []
    for p in paths:
        d = json.loads(Path(p).read_text())
        meta = d["meta"]
        if "copy_bandwidth_end" not in meta and not meta.get("incomplete") and not meta.get("dry_run"):
            passes = sorted({r.get("pass") for r in d["results"]} - {None})
            meta = dict(meta, incomplete="the run stopped before its end-of-run copy measurement "
                        f"(stopped early, e.g. by a time limit); provider-order passes present: {passes or 'none'}")
        metas.append((Path(p), meta))
        for r in d["results"]:
            rows.append({**r, "_copy_GBps": d["meta"].get("copy_GBps"), "_file": Path(p).name})
    return metas, rows


def _median(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _shape(r):
    """The fixed part of a case's shape (format 2 rows carry it; older norm rows: hidden)."""
    return r.get("shape") or f"hidden {r['hidden_size']}"


def _x(r):
    """The swept size of a case (format 2: ``x``; older norm rows: num_tokens)."""
    return r["x"] if "x" in r else r["num_tokens"]


def aggregate(rows: list[dict]) -> dict:
    """(op, l2, dtype, shape, x, provider) -> medians over passes, or status/reason."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["op"], r.get("l2", "warm"), r["dtype"], _shape(r), _x(r),
                r["provider"])].append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if r.get("status") == "ok" and r.get("graph_us")]
        if not ok:
            out[key] = {"status": rs[-1].get("status"), "reason": rs[-1].get("reason", "")}
            continue
        g = [r["graph_us"] for r in ok]
        graph_us = statistics.median(g)
        copy = _median(r["_copy_GBps"] for r in ok)
        gbps = ok[0]["bytes"] / (graph_us * 1e-6) / 1e9
        exact = next((r["exact"] for r in ok if r.get("exact")), None)
        out[key] = {"status": "ok", "graph_us": graph_us, "GBps": gbps,
                    "pct_copy": 100 * gbps / copy if copy else None,
                    "eager_us": _median(r.get("eager_us") for r in ok),
                    "host_us": _median(r.get("host_us") for r in ok),
                    "spread": (max(g) - min(g)) / graph_us if len(g) > 1 else None,
                    "passes": len(ok), "exact": exact,
                    "exact_note": next((r["exact_note"] for r in ok if r.get("exact_note")), None)}
    return out


def _fmt(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def _cell(text, n=80) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(str(text).split())[:n].replace("|", "\\|")


def _pct(f):
    if f is None:
        return "—"
    return "100%" if f == 1.0 else f"{100 * f:.3f}%"


def _providers(agg, sel):
    present = {k[5] for k in agg if k[:4] == sel}
    return [p for p in PROVIDER_ORDER if p in present] + sorted(present - set(PROVIDER_ORDER))


def op_section(agg: dict, sel: tuple, plots: list[str], x_axis="num_tokens") -> list[str]:
    op, l2, dtype, shape = sel
    provs = _providers(agg, sel)
    nts = sorted({k[4] for k in agg if k[:4] == sel})
    outputs = next((list(v["exact"]) for k, v in agg.items()
                    if k[:4] == sel and v.get("exact")), [])
    lines = [f"### {op} — {shape}, {dtype}, L2 {l2}", ""]
    if l2 == "cold":
        lines += ["L2 cold: every call reads a new set of buffers (rotated through more than twice "
                  "the L2), so each eager loomnb call has new data pointers, misses the launch "
                  "cache and is validated and packed again; its eager µs is that path's cost.", ""]
    lines += [f"| {x_axis} | provider | graph µs | eager µs | GB/s | % copy bw | byte-exact vs "
              f"ref ({' / '.join(outputs) or 'n/a'}) | pass spread % |",
              "|---:|---|---:|---:|---:|---:|---|---:|"]
    for nt in nts:
        for p in provs:
            a = agg.get(sel + (nt, p))
            if a is None:
                continue
            if a["status"] != "ok":
                lines.append(f"| {nt} | {p} | {a['status']} | | | | {_cell(a['reason'])} | |")
                continue
            spread = None if a["spread"] is None else 100 * a["spread"]
            ex = (" / ".join(_pct(a["exact"].get(o)) for o in outputs) if a["exact"]
                  else _cell(a["exact_note"] or "—", 60))
            lines.append(f"| {nt} | {p} | {_fmt(a['graph_us'])} | {_fmt(a['eager_us'])} | "
                         f"{_fmt(a['GBps'], '.0f')} | {_fmt(a['pct_copy'], '.1f')} | {ex} | "
                         f"{_fmt(spread, '.1f')} |")
    peers = [p for p in provs if p != SUBJECT]
    if SUBJECT in provs and peers:
        lines += ["", f"{SUBJECT} speedup = peer graph µs / {SUBJECT} graph µs "
                  "(**bold** where below 1.00, i.e. the peer is faster):", "",
                  f"| {x_axis} | " + " | ".join(peers) + " |",
                  "|---:|" + "---:|" * len(peers)]
        for nt in nts:
            cells = []
            for p in peers:
                r = ratio(agg, sel + (nt,), p)
                cells.append("—" if r is None else (f"**{r:.2f}**" if r < 1 else f"{r:.2f}"))
            lines.append(f"| {nt} | " + " | ".join(cells) + " |")
    small = nts[0] if nts else None
    lines += ["", f"Eager (Python loop) at {x_axis}={small}: host µs is the time to issue one "
              "call; if it is close to eager µs the host, not the GPU, is the bottleneck.", "",
              "| provider | eager µs | host µs | graph µs |", "|---|---:|---:|---:|"]
    for p in provs:
        a = agg.get(sel + (small, p))
        if a and a["status"] == "ok":
            lines.append(f"| {p} | {_fmt(a['eager_us'])} | {_fmt(a['host_us'])} | "
                         f"{_fmt(a['graph_us'])} |")
    lines += [""] + [f"![{Path(pl).stem}]({Path(pl).name})" for pl in plots] + [""]
    return lines


def ratio(agg, key5, peer):
    a, b = agg.get(key5 + (SUBJECT,)), agg.get(key5 + (peer,))
    if a and b and a["status"] == b["status"] == "ok":
        return b["graph_us"] / a["graph_us"]
    return None


def plot(agg: dict, sel: tuple, out_dir: Path, copy_gbps, family="norm", x_axis="num_tokens") -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    op, l2, dtype, shape = sel
    h = shape
    provs = _providers(agg, sel)
    nts = sorted({k[4] for k in agg if k[:4] == sel})
    tag = "".join(c if c.isalnum() else "_" for c in shape.replace("hidden ", "h")).strip("_")
    stem = f"{family}_{op}_{tag}_{dtype}_{l2}"
    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in provs:
        pts = [(nt, agg[sel + (nt, p)]["GBps"]) for nt in nts
               if agg.get(sel + (nt, p), {}).get("status") == "ok"]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=p, lw=2.5 if p == SUBJECT else 1.5)
    if copy_gbps:
        ax.axhline(copy_gbps, ls="--", color="gray", label=f"copy bw {copy_gbps:.0f} GB/s")
    ax.set(xscale="log", yscale="log", xlabel=x_axis,
           ylabel="effective GB/s (bytes model / graph time)",
           title=f"{op}\n{h}, {dtype}, L2 {l2}")
    ax.set_xticks(nts, [str(n) for n in nts])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(out_dir / f"{stem}_bandwidth.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    peers = [p for p in provs if p != SUBJECT]
    if any(ratio(agg, sel + (nt,), p) is not None for nt in nts for p in peers):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p in peers:
            pts = [(nt, r) for nt in nts if (r := ratio(agg, sel + (nt,), p)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"vs {p}")
        ax.axhline(1.0, ls="--", color="gray")
        ax.set(xscale="log", yscale="log", xlabel=x_axis,
               ylabel=f"{SUBJECT} speedup (peer µs / {SUBJECT} µs)",
               title=f"{op}: {SUBJECT} vs peers\n{h}, {dtype}, L2 {l2}")
        ax.set_xticks(nts, [str(n) for n in nts])
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        files.append(out_dir / f"{stem}_ratio.png")
        fig.tight_layout()
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return [str(f) for f in files]


def header(metas) -> list[str]:
    lines = ["# Benchmark summary", ""]
    for path, m in metas:
        if m.get("dry_run"):
            lines += ["> **DRY RUN — every number below is FAKE** (plumbing test, no GPU).", ""]
        if m.get("incomplete"):
            lines += [f"> **INCOMPLETE run** ({path.name}): {m['incomplete']}", ""]
        v = m.get("versions", {})
        cb = m.get("copy_bandwidth", {})
        lines += [f"- `{path.name}`: {m.get('gpu') or m.get('device')}, {m.get('date')}, "
                  f"commit `{m.get('git_commit')}`, L2 {m.get('l2')}, exactness reference "
                  f"{m.get('exact_ref')}",
                  f"  - copy bandwidth (torch.mul bf16, graph): {_fmt(m.get('copy_GBps'), '.0f')}"
                  f" GB/s (start {_fmt(cb.get('GBps'), '.0f')}, end "
                  f"{_fmt(m.get('copy_bandwidth_end', {}).get('GBps'), '.0f')})",
                  "  - versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
                  f"  - flags: `{json.dumps(m.get('flags', {}))}`"]
        vl = m.get("vllm")
        if vl:
            lines += [f"  - vLLM ops from `{vl.get('lib')}`; schemas and bindings:"]
            lines += [f"    - `{s}`" for s in vl.get("schemas", {}).values()]
            lines += [f"    - {op}: `{b}`" for op, b in vl.get("bindings", {}).items()]
        skips = {(n, p["skip"]) for n, p in m.get("providers", {}).items() if p.get("skip")}
        lines += [f"  - provider **{n}** skipped: {why}" for n, why in sorted(skips)]
    lines += ["", "graph µs: per call, CUDA-graph replay of back-to-back calls (median over "
              "repeats, then over provider-order passes). eager µs: per call of a Python loop, "
              "synchronised at both ends. GB/s: bytes model / graph µs. % copy bw: of the "
              "measured torch.mul bandwidth. byte-exact: fraction of output bytes equal to the "
              "reference's on the same fresh inputs.", ""]
    return lines


def extra_sections(results_dir: Path, given: dict | None = None) -> list[str]:
    """The eager-overhead (bench_overhead.py) and decode-TPOT (bench_decode.py) results: the
    files ``given`` names (``{"overhead": path, "decode": path}``), else the newest of each."""
    def newest_or_none(pattern):
        try:
            return newest(results_dir, pattern)
        except SystemExit:
            return None

    given = given or {}
    lines = []
    path = given.get("overhead") or newest_or_none("overhead_*.json")
    if path is not None:
        data = json.loads(path.read_text())
        cpu = f", host CPU {data['host_cpu']}" if "host_cpu" in data else ""
        lines += ["", f"### Eager per-call host overhead — `{path.name}` ({data['gpu']}, torch {data['torch']}{cpu})",
                  "", "1 x 4096 bf16; wall time of N calls / N, no synchronisation inside the loop; "
                  "median of the forward and reversed passes.", "",
                  "| call | µs per call | x torch.mul(out=) |", "|---|---:|---:|"]
        base = data["us_per_call"].get("torch.mul(x, 2.0, out=)")
        lines += [f"| `{name}` | {us:.2f} | {us / base:.2f} |" if base else f"| `{name}` | {us:.2f} | |"
                  for name, us in data["us_per_call"].items()]
        if "fast_path_pieces_us" in data:
            lines += ["", "Pieces of loomnb's fast path, timed alone:", "", "| piece | µs |", "|---|---:|"]
            lines += [f"| {name} | {us:.2f} |" for name, us in data["fast_path_pieces_us"].items()]
    path = given.get("decode") or newest_or_none("decode_2*.json")  # not decode_attention_*
    if path is not None:
        data = json.loads(path.read_text())
        lines += ["", f"### SmolLM2-135M decode step (TPOT) — `{path.name}`", "",
                  f"{data['model']}, {data['steps']} decode steps after prefill; graphed = the whole "
                  "step (bookkeeping included) in one CUDA graph.", "",
                  "| batch | backend | mode | TPOT ms | tokens/s | tokens identical (all 4 runs) |",
                  "|---:|---|---|---:|---:|---|"]
        old = [r for r in data["rows"] if "backend" in r]  # files before the provider sweep
        lines += [f"| {r['batch']} | {r['backend']} | {'graph' if r['graphed'] else 'eager'} | "
                  f"{r['tpot_ms']:.3f} | {r['tokens_per_s']:.0f} | {r['tokens_identical']} |"
                  for r in old]
        new = [r for r in data["rows"] if "provider" in r]
        if new:
            lines[-len(old) - 2:] = [
                "| order | provider | context | batch | mode | TPOT ms | tokens/s | kernels/step "
                "| kernels/layer | graph == eager |", "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
            lines += [f"| {r['order']} | {r['provider']} | {r['context']} | {r['batch']} | "
                      f"{r['mode']} | " + (f"{r['tpot_ms']:.3f} | {r['tokens_per_s']:.0f}"
                                          if "tpot_ms" in r else f"error: {r.get('error')} | ")
                      + f" | {r.get('kernels_per_step')} | {r.get('kernels_per_layer')} | "
                      f"{r.get('graph_equals_eager')} |" for r in new]
    return lines


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description="Summarise benchmark JSON into SUMMARY.md + plots")
    ap.add_argument("files", nargs="*", type=Path, help="result JSON files (default: newest)")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help=f"where to find the newest results (default: {RESULTS_DIR})")
    ap.add_argument("--dry-run", action="store_true",
                    help=f"summarise bench_*.py --dry-run's files: --results-dir and --out-dir "
                         f"{DRY_RUN_DIR}")
    ap.add_argument("--pattern", action="append",
                    help="glob(s) for picking the newest file of each (default: every family's "
                         + ", ".join(f"{f}_*.json" for f in FAMILY_PREFIXES) + ")")
    ap.add_argument("--out-dir", type=Path,
                    help=f"where SUMMARY.md and the plots go (default: the --results-dir when "
                         f"one is named, else {SUMMARY_DIR}; --out-dir benchmarks/results "
                         f"regenerates the committed summary)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    named = args.results_dir
    if args.dry_run:
        named = args.results_dir = args.results_dir or DRY_RUN_DIR
    args.results_dir = args.results_dir or RESULTS_DIR
    given, files = {}, []
    for f in args.files:  # the decode-step and overhead files have their own sections
        d = json.loads(Path(f).read_text())
        kind = "meta" if "meta" in d else "overhead" if "us_per_call" in d else (
            "decode" if "rows" in d and "model" in d else None)
        if kind is None:
            sys.exit(f"{f}: not a result file of a bench_*.py (no 'meta', 'us_per_call' or "
                     "decode 'rows')")
        if kind == "meta":
            files.append(f)
        else:
            given[kind] = Path(f)
    files = files or _newest_of_each(args.results_dir, args.pattern)
    out_dir = args.out_dir or named or SUMMARY_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    metas, rows = load(files)
    lines = header(metas)
    families = dict.fromkeys(m.get("benchmark", "norm") for _, m in metas)
    for fam in families:
        fam_metas = [(p, m) for p, m in metas if m.get("benchmark", "norm") == fam]
        names = {p.name for p, _ in fam_metas}
        fam_rows = [r for r in rows if r["_file"] in names]
        x_axis = fam_metas[0][1].get("x_axis", "num_tokens")
        agg = aggregate(fam_rows)
        copy = _median(m.get("copy_GBps") for _, m in fam_metas)
        if len(families) > 1:
            lines += [f"## {fam}", ""]
        for sel in dict.fromkeys(k[:4] for k in agg):
            plots = [] if args.no_plots else plot(agg, sel, out_dir, copy, fam, x_axis)
            lines += op_section(agg, sel, plots, x_axis)
    lines += extra_sections(args.results_dir, given)
    md = out_dir / "SUMMARY.md"
    md.write_text("\n".join(lines) + "\n")
    print(f"wrote {md}" + ("" if args.no_plots else " and plots") + (
        f" ({RESULTS_DIR / 'SUMMARY.md'} is unchanged: --out-dir {RESULTS_DIR} regenerates it)"
        if out_dir.resolve() != RESULTS_DIR.resolve() and args.results_dir == RESULTS_DIR else ""))
    return md


if __name__ == "__main__":
    main()
