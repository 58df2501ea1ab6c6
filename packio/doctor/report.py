"""A diagnosis for a person: terminal text, Markdown, and one PNG."""

from __future__ import annotations

from pathlib import Path

from packio.doctor.candidates import Candidate
from packio.doctor.loop import INPUT_BOUND
from packio.doctor.offline import Diagnosis
from packio.doctor.stages import STAGES, StageCosts

__all__ = ["verdict", "recommendation", "text", "markdown", "plot", "write"]


def _mb(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _n(rate: float) -> str:
    """A rate as printed: whole numbers, two significant digits below 10 (a huge image: 0.34/s)."""
    return f"{rate:.0f}" if rate >= 10 or rate == 0 else f"{rate:.2g}"


def _settings(s: dict) -> str:
    if not s:
        return "-"
    parts = [f"workers {s.get('num_workers', 0)}"]
    if s.get("prefetch_factor"):
        parts.append(f"prefetch {s['prefetch_factor']}")
    if s.get("threads"):
        parts.append(f"threads {s['threads']}")
    return ", ".join(parts)


def _stage_line(st: StageCosts) -> str:
    us = " · ".join(f"{name} {getattr(st, name) * 1e6:.0f}" for name in STAGES)
    return f"{us} = {st.total * 1e6:.0f} µs"


def _rows(d: Diagnosis) -> list[tuple[str, Candidate, list[str]]]:
    """(rank label, candidate, cells) in ranked order: 1, 2, ... for layouts, 'now' for
    the data as it is, '-' for errors. Cells: samples/s, CPU µs/sample, ≤/s on the CPUs,
    × now, size of the full set, loader settings, note."""
    out, rank = [], 0
    for c in d.candidates:
        rank += not (c.now or c.error)
        cells = [f"{'~' if c.estimated else ''}{_n(c.samples_per_s)}", f"{c.cpu_per_sample * 1e6:.0f}",
                 _n(c.ceiling(d.cpus)), _vs_now(d, c), _mb(c.full_bytes), _settings(c.settings), _cell_note(c)]
        out.append(("-" if c.error else "now" if c.now else str(rank), c, cells))
    return out


def _vs_now(d: Diagnosis, c: Candidate) -> str:
    base = d.expected(d.now) if d.now and not d.now.error else 0.0
    return f"{d.expected(c) / base:.1f}" if base > 0 else "-"


def _fix(d: Diagnosis, need: float) -> Candidate | None:
    """The layout to move to: the smallest that keeps the step fed (random crops kept when
    one does), else the fastest."""
    ok = [c for c in d.candidates if not c.now and not c.error and d.expected(c) >= need]
    pool = [c for c in ok if c.keeps_crops] or ok
    return min(pool, key=lambda c: c.full_bytes) if pool else d.best


def figure(d: Diagnosis, c: Candidate) -> str:
    """``c``'s samples/s as what it is: measured, measured on a busy machine (with the estimate
    from its CPU time beside it), or estimated from its stage costs (and why)."""
    if c.estimated:
        return f"~{_n(c.samples_per_s)} samples/s, estimated from its stage costs ({c.estimated.split(';')[0]})"
    if d.busy:
        return (f"{_n(c.samples_per_s)} samples/s measured on the busy machine, ≤{_n(c.ceiling(d.cpus))} estimated "
                f"from its CPU time were the {d.cpus} CPUs its own")
    return f"{_n(c.samples_per_s)} samples/s measured"


def keeps_up(d: Diagnosis) -> bool | None:
    """Whether the data as it is keeps the step (--step-ms) fed, as measured; None: no step given."""
    now, need = d.now, d.needed
    if need is None or now is None or now.error:
        return None
    return max(0.0, 1 - now.samples_per_s / need) < INPUT_BOUND


def verdict(d: Diagnosis) -> list[str]:
    """The answer first: does training wait on this data as it is, and if so what to do.
    Decided on what was measured; an estimate is said to be one."""
    now, need = d.now, d.needed
    if now is None or now.error:
        return [f"verdict: the data as it is could not be timed ({now.error if now else 'no baseline'}); "
                "the ranking below compares the layouts"]
    have = now.samples_per_s
    if need is None:
        return [f"verdict: as it is, the data feeds {figure(d, now)}, so a training step of {d.batch_size} "
                f"taking {d.batch_size / max(have, 1e-9) * 1e3:.0f} ms or more never waits for it; "
                "give --step-ms to know whether yours does"]
    share = max(0.0, 1 - have / need)  # of the time the step would wait (the loader overlapping the step)
    facts = f"{now.title}: {figure(d, now)}; a {d.step_ms:g} ms step of {d.batch_size} takes {need:.0f}"
    if keeps_up(d):  # the line the in-loop watch() draws too
        return [f"verdict: your loader keeps up: nothing to change ({facts}"
                + (f"; waits ~{share * 100:.0f} % of the time, not worth a conversion)" if share else ")")]
    if d.busy and 1 - d.expected(now) / need < INPUT_BOUND:
        return [f"verdict: on this busy machine training would wait ~{share * 100:.0f} % of the time ({facts}); "
                "by the CPU time it used it would keep up on CPUs of its own: measure again on a quiet machine "
                "before converting anything"]
    wait = f"verdict: training waits ~{share * 100:.0f} % of the time ({facts})"
    fix = _fix(d, need)
    if fix is None:
        return [wait + "; no other layout could be measured: see the errors below"]
    enough = d.expected(fix) >= need
    return [f"{wait}; do: {fix.convert_line}",
            *(["  then read it with:", *[f"    {x.strip()}" for x in fix.reader_lines]] if fix.reader_lines else []),
            f"  ({fix.title}: {figure(d, fix)}"
            + (", enough)" if enough else ", the fastest here but still short: more CPUs, or GPU decode)")]


def recommendation(d: Diagnosis) -> list[str]:
    """The ranked advice: what to convert to, and the exact lines."""
    best, crops, now = d.best, d.best_with_crops, d.now
    if best is None:
        return ["no layout could be measured (see the errors above)"]
    base = d.expected(now) if now and not now.error else 0.0
    head = ("recommendation: nothing to change (your loader keeps up); were your step to get faster, the fastest "
            "layout here: " if keeps_up(d) else "recommendation: ")
    lines = [f"{head}{best.title}: {figure(d, best)}"
             + (f", {d.expected(best) / base:.1f} × {now.title}" if base else "")  # type: ignore[union-attr]
             + f"; {_mb(best.full_bytes)} for all {d.count} samples",
             f"  {best.convert_line}", *[f"  {x}" for x in best.reader_lines], *_enlarged_lines(d, best)]
    if not best.keeps_crops:
        lines.append(f"  note: this fixes the {d.size}x{d.size} crop at pack time (flips and GPU-side augmentation "
                     "only).")
        if crops is not None:
            lines += [f"  with random-resized crops: {crops.title}: {figure(d, crops)}, "
                      f"{_mb(crops.full_bytes)}", f"  {crops.convert_line}", *[f"  {x}" for x in crops.reader_lines]]
    if d.needed:
        ok = [c for c in d.candidates if not c.error and d.expected(c) >= d.needed]
        basis = " by their CPU time (the machine was busy)" if d.busy else ""
        lines.append(f"a {d.step_ms:g} ms step of {d.batch_size} takes {d.needed:.0f} samples/s: "
                     + (f"kept fed{basis} by {', '.join(c.title for c in ok)}" if ok else
                        "no layout keeps it fed on these CPUs (expect waits: see the GPU line, or more CPUs)"))
        small = min((c for c in ok if c.keeps_crops), key=lambda c: c.full_bytes, default=None)
        if small is not None and small is not crops:
            lines.append(f"  the smallest that does, keeping random crops: {small.title}, {_mb(small.full_bytes)}"
                         + (f": {small.convert_line}" if small.convert_line else " (no conversion needed)"))
        if now and not now.error and d.expected(now) < d.needed:
            lines.append(f"  as it is now the step would wait ~{(1 - d.expected(now) / d.needed) * 100:.0f} % "
                         "of the time (estimate: data time beyond the step, with the loader overlapping the step)")
    return lines


def _enlarged_lines(d: Diagnosis, c: Candidate) -> list[str]:
    if not c.enlarged:
        return []
    return [f"  note: it enlarges {c.enlarged} of the {d.sample} sampled images (smaller than its size): stored with "
            "more pixels than they have, larger and no sharper; a smaller size keeps them as they are"]


def _cell_note(c: Candidate) -> str:
    """The table's note on ``c``: what limits its figures."""
    notes = [c.note] if c.note else []
    if c.estimated:
        notes.append(c.estimated)
    if c.timed_batch:
        notes.append(f"timed with batches of {c.timed_batch}: a full batch would not fit --seconds")
    if c.enlarged:
        notes.append(f"enlarges {c.enlarged} sampled images")
    return "; ".join(notes)


def _error_text(c: Candidate) -> str:
    return c.error if c.error.startswith("not measured") else f"error: {c.error}"


def text(d: Diagnosis) -> str:
    st = d.stages
    pct = 100 * d.sample / max(d.count, 1)
    lines = [*filter(None, verdict(d)), "",
             f"packio doctor — {d.source}",
             f"budget: {d.budget.text()} → timing with {d.cpus} CPUs, num_workers tried {d.workers_tried}",
             f"sample: {d.sample} of {d.count} ({pct:.1f} %), training size {d.size}, batch {d.batch_size}; "
             f"took {d.elapsed:.0f} s of a {d.seconds:g} s budget",
             "",
             f"per-sample cost on one core, as stored (µs, {st.n} samples): {_stage_line(st)}",
             f"  → at most {_n(st.per_core())} samples/s per core, {_n(st.per_core() * d.cpus)} on {d.cpus} CPUs; "
             f"decode {st.share('decode') * 100:.0f} %, resize {st.share('resize') * 100:.0f} % "
             f"(stored images ~{st.stored_hw[1]}x{st.stored_hw[0]} px)",
             "",
             f"{'rank':>4}  {'layout':32s} {'samples/s':>9} {'CPU µs/sample':>13} {f'≤/s on {d.cpus} CPUs':>15} "
             f"{'× now':>6} {'full set':>8}  loader settings"]
    widths = (9, 13, 15, 6, 8)
    for label, c, cells in _rows(d):
        lines.append(f"{label:>4}  {c.title:32s} " + (_error_text(c) if c.error else " ".join(
            f"{v:>{w}}" for v, w in zip(cells, widths)) + f"  {cells[-2]}" + (f"  ({cells[-1]})" if cells[-1] else "")))
    lines.append(f"      (samples/s: measured, ~ estimated; CPU µs/sample: the timed loader's, all its threads and "
                 f"processes; ≤/s: CPU time → what {d.cpus} CPUs of its own could give; ranked by "
                 f"{'≤/s: the machine was busy' if d.busy else 'samples/s'})")
    lines += ["", *recommendation(d), "", *d.gpu.lines, ""]
    lines += [f"note: {n}" for n in d.notes]
    return "\n".join(lines)


def markdown(d: Diagnosis, png: str | None) -> str:
    md = [f"# packio doctor — {d.source}", "", *[x.strip() for x in verdict(d) if x], "",
          f"- budget: {d.budget.text()}; timed with {d.cpus} CPUs, num_workers tried {d.workers_tried}",
          f"- sample: {d.sample} of {d.count}, training size {d.size}, batch {d.batch_size}; "
          f"{d.elapsed:.0f} s of a {d.seconds:g} s budget",
          "", "## Per-sample cost: each stage on one core, and the timed loader (µs)", "",
          "| layout | " + " | ".join(STAGES) + " | total | samples/s per core | timed loader, CPU µs/sample |",
          "|---|" + "---:|" * (len(STAGES) + 3)]
    for c in [x for x in d.candidates if x.stages is not None]:
        s = c.stages
        md.append(f"| {c.title} | " + " | ".join(f"{getattr(s, k) * 1e6:.0f}" for k in STAGES)
                  + f" | {s.total * 1e6:.0f} | {_n(s.per_core())} | {_timed_cpu(c)} |")
    md += ["", "Stages: one sample at a time on one core, counting only the stages its loader runs (transfer: "
           "with worker processes; resize: when the reader resizes). The timed loader decodes whole batches on "
           "its threads (no separate collate): its CPU time per sample is the one the ranking uses."]
    md += ["", "## Layouts, ranked (warm page cache, settings from packio.tune)", "",
           f"| rank | layout | samples/s | CPU µs/sample | ≤/s on {d.cpus} CPUs | × now | size, full set | "
           "loader settings | note |",
           "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for label, c, cells in _rows(d):
        md.append(f"| {label} | {c.title} | " + (f"{_error_text(c)} | | | | | | |" if c.error else
                                                  " | ".join(cells) + " |"))
    md += ["", f"samples/s: measured (wall clock); ≤/s: from the CPU time spent per sample, what {d.cpus} CPUs of its "
           f"own could give (an upper bound); ranked by {'≤/s, as the machine was busy' if d.busy else 'samples/s'}."]
    rec = recommendation(d)
    md += ["", "## Recommendation", "", rec[0], "", "```bash" if rec[1:] else ""]
    for line in rec[1:]:
        md.append(line.strip())
    md += ["```", "", "## GPU decode", "", *[f"- {x}" for x in d.gpu.lines], "", "## Notes", "",
           *[f"- {n}" for n in d.notes], ""]
    md.append(f"![stage costs and layouts]({png})" if png else
              "(no chart: matplotlib is missing; `pip install 'packio[bench]'`)")
    return "\n".join(md) + "\n"


def _timed_cpu(c: Candidate) -> str:
    return "-" if c.error or c.estimated or not c.cpu_per_sample else f"{c.cpu_per_sample * 1e6:.0f}"


def log_axis(values: list[float]) -> bool:
    """Whether positive values span a decade or more (then a log axis shows them all)."""
    pos = [v for v in values if v > 0]
    return len(pos) > 1 and max(pos) >= 10 * min(pos)


def plot(d: Diagnosis, path: Path) -> None:
    """Stage costs as stacked bars (per layout measured), layouts as bars with values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_stages = [c for c in d.candidates if c.stages is not None]
    ranked = [c for c in d.candidates if not c.error][::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, max(3.5, 0.55 * len(ranked) + 2)))
    colors = ["#8c8c8c", "#dd8452", "#55a868", "#4c72b0", "#c44e52"]
    left = [0.0] * len(with_stages)
    for stage, color in zip(STAGES, colors):
        vals = [getattr(c.stages, stage) * 1e6 for c in with_stages]
        ax1.barh(range(len(with_stages)), vals, left=left, color=color, label=stage)
        left = [a + v for a, v in zip(left, vals)]
    for y, (total, c) in enumerate(zip(left, with_stages)):
        timed = _timed_cpu(c)
        ax1.text(total, y, f" {total:.0f}" + (f" (timed loader: {timed})" if timed != "-" else ""), va="center",
                 fontsize=8)
    ax1.set_yticks(range(len(with_stages)), [c.title for c in with_stages], fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("µs of CPU per sample: each stage on one core (the timed loader's CPU time in brackets)")
    ax1.set_title("where the time goes (the stages its loader runs)")
    ax1.legend(fontsize=8, ncol=len(STAGES), loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    rates = [d.expected(c) for c in ranked]
    ax2.barh(range(len(ranked)), rates, color=["#8c8c8c" if c.now else "#4c72b0" for c in ranked],
             hatch=["//" if c.estimated or d.busy else "" for c in ranked], edgecolor="white")
    for y, (r, c) in enumerate(zip(rates, ranked)):
        ax2.text(r, y, f" {'~' if c.estimated else ''}{_n(r)}" + (f" (measured {_n(c.samples_per_s)})" if d.busy and
                 not c.estimated else " (estimated)" if c.estimated else ""), va="center", fontsize=8)
    ax2.set_yticks(range(len(ranked)), [c.title + (" (now)" if c.now else "") for c in ranked], fontsize=8)
    ax2.set_xlabel(f"samples/s with {d.cpus} CPUs (batch {d.batch_size}, {d.size}x{d.size})"
                   + ("" if d.busy else ", measured")
                   + ("\nhatched: estimated from CPU time per sample (the machine was busy), measured in brackets"
                      if d.busy else "") + ("; ~: estimated from stage costs" if any(c.estimated for c in ranked)
                                            else ""))
    ax2.set_title("layouts, timed with packio.tune's settings")
    if d.needed:
        ax2.axvline(d.needed, color="red", ls="--", label=f"step needs {d.needed:.0f}/s")
        ax2.legend(fontsize=8, loc="lower right")
    values = [r for r in rates + [d.needed or 0] if r > 0]
    if log_axis(values):  # rates spanning decades: a linear axis flattens the slow bars against zero
        ax2.set_xscale("log")
        ax2.set_xlabel(ax2.get_xlabel() + " (log scale)")
        ax2.set_xlim(min(values) / 2, max(values) * (8 if d.busy else 3))  # room for the labels
    else:
        ax2.set_xlim(0, max(values) * 1.18 if values else 1)
    fig.suptitle(f"packio doctor — {d.source}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def write(d: Diagnosis, folder: str | Path) -> tuple[Path, Path | None]:
    """``folder/doctor.md`` and ``folder/doctor.png`` (PNG skipped, with a note,
    without matplotlib). Each is written under a temporary name, then renamed."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    png: Path | None = out / "doctor.png"
    try:
        tmp = out / ".doctor.png.tmp"
        plot(d, tmp)
        tmp.rename(png)  # type: ignore[arg-type]
    except ImportError:
        png = None
    md = out / "doctor.md"
    tmp_md = out / ".doctor.md.tmp"
    tmp_md.write_text(markdown(d, png.name if png else None))
    tmp_md.rename(md)
    return md, png
