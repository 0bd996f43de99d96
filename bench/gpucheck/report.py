"""The acceptance run's report as markdown: the card, then one table of figures and one of checks a section."""

from __future__ import annotations


def _cell(value, fmt: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if fmt == "%" and isinstance(value, (int, float)):
        return f"{value:.0%}"
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


def table(columns: list, rows: list[dict]) -> list[str]:
    lines = [
        "| " + " | ".join(h for _, h, _ in columns) + " |",
        "|" + "|".join("---:" if f else "---" for _, _, f in columns) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(k), f) for k, _, f in columns) + " |")
    return lines


def markdown(report: dict) -> str:
    c = report["card"]
    kind = "dry run on the CPU (tiny shapes; the figures mean nothing)" if report["dry_run"] else c["name"]
    mem = f"{c['memory_gib']:.0f} GiB, " if c.get("memory_gib") else ""
    out = [
        f"# kvscope on a GPU: {kind}",
        "",
        f"{report['date']}; {mem}"
        f"driver {c.get('driver')}, Python {c['python']}, torch {c['torch']} (CUDA {c.get('cuda')}), "
        f"Triton {c['triton']}, transformers {c['transformers']}; datasheet peaks {c.get('peak_gbs')} GB/s, "
        f"{c.get('peak_tflops')} TFLOP/s dense fp16; the run took {report['seconds']:.0f} s.",
        "",
        "| section | verdict | seconds |",
        "|---|---|---:|",
    ]
    for s in report["sections"]:
        out.append(f"| {s['name']}: {s['title']} | {s['verdict']} | {s['seconds']:.0f} |")
    for s in report["sections"]:
        out += ["", f"## {s['name']}: {s['title']}", "", f"Verdict: **{s['verdict']}** ({s['seconds']:.0f} s)"]
        for t in s.get("tables", []):
            out += ["", f"{t['title']}:", ""] + table(t["columns"], t["rows"])
        if s.get("checks"):
            out += ["", "| check | value | aim | met |", "|---|---|---|---|"]
            for k in s["checks"]:
                met = "yes" if k["ok"] else ("NO" if k["hard"] else "no (aim)")
                out.append(f"| {k['what']} | {k['value']} | {k['aim']} | {met} |")
        for n in s.get("notes", []):
            out += ["", n]
    return "\n".join(out) + "\n"
