"""The decode benchmark's report (scripts/bench_decode.py): token agreement with the eager
hand-written step, ratios and goals, the Markdown tables."""

from __future__ import annotations

from bench_common import environment_markdown, markdown_table


def add_parity(rows: list[dict]) -> None:
    """Token agreement with hand_eager of the same workload (hf: different model, n/a)."""
    for r in rows:
        ref = next(
            (
                x
                for x in rows
                if x["workload"] == r["workload"]
                and x["status"] == "ok"
                and x["mode"] in ("hand_eager", "hand_continuous_eager")
            ),
            None,
        )
        if r["status"] != "ok" or "tokens" not in r or ref is None:
            r["token_agreement"] = None
            continue
        pairs = [(a, c) for ta, tc in zip(r["tokens"], ref["tokens"]) for a, c in zip(ta, tc)]
        r["token_agreement"] = sum(a == c for a, c in pairs) / len(pairs) if pairs else None
    for r in rows:
        r.pop("tokens", None)  # keep the JSON small


def add_ratios(rows: list[dict]) -> tuple[dict, dict]:
    """Per fixed-batch mode: ms over hand_graph's, HF's ms over its; TTFT over eager prefill's.
    Returns (ratios, goals): the decode targets and whether the numbers meet them."""

    def ms(workload: str, mode: str) -> float | None:
        r = next((x for x in rows if x["workload"] == workload and x["mode"] == mode), None)
        return r.get("ms_median") if r and r["status"] == "ok" else None

    ratios: dict = {}
    for r in rows:
        if r["status"] != "ok" or not r.get("ms_median") or r["workload"] == "mixed":
            continue
        if r["workload"].startswith("ttft"):
            base = ms(r["workload"], "ttft_prefill_eager")
            r["x_ttft_prefill_eager"] = r["ms_median"] / base if base else None
            ratios[f"{r['workload']}/{r['mode']}"] = {"x_prefill_eager": r["x_ttft_prefill_eager"]}
            continue
        hand, hf = ms(r["workload"], "hand_graph"), ms(r["workload"], "hf_generate")
        r["x_hand_graph"] = r["ms_median"] / hand if hand else None
        r["hf_speedup"] = hf / r["ms_median"] if hf else None
        ratios[f"{r['workload']}/{r['mode']}"] = {
            "x_hand_graph": r["x_hand_graph"],
            "hf_speedup": r["hf_speedup"],
        }
    goals = {}
    for r in rows:
        if r["mode"] == "engine_graphs" and r.get("x_hand_graph") is not None:
            x = r["x_hand_graph"]
            goals[f"{r['workload']}: engine_graphs <= 1.05x hand_graph"] = [round(x, 3), x <= 1.05]
            if r["batch"] == 1 and r.get("hf_speedup") is not None:
                h = r["hf_speedup"]
                goals["batch 1: engine_graphs >= 10x hf_generate"] = [round(h, 2), h >= 10]
        if r["mode"] == "ttft_prefill_graphs" and r.get("x_ttft_prefill_eager") is not None:
            x = r["x_ttft_prefill_eager"]
            goals[f"{r['workload']}: prefill graphs <= 0.5x eager prefill"] = [
                round(x, 3),
                x <= 0.5,
            ]
    return ratios, goals


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    parts = [
        "# Decode benchmark",
        "",
        environment_markdown(meta["env"]),
        "",
        f"Model: {meta['model']}. Prompt length {meta['prompt_len']}, {meta['steps']} "
        f"decode steps after {meta['warmup']} warmup steps; greedy. {meta['notes']}",
    ]
    if payload.get("goals"):
        parts += ["", "## Goals", ""]
        parts.append(
            markdown_table(
                ["goal", "measured", "met"], [[k, v[0], v[1]] for k, v in payload["goals"].items()]
            )
        )
    headers = [
        "mode",
        "ms/step",
        "tokens/s",
        "x hand_graph",
        "peak MiB",
        "capture s",
        "token agreement",
        "status",
    ]
    for wl in dict.fromkeys(r["workload"] for r in payload["results"]):
        rows = [r for r in payload["results"] if r["workload"] == wl]
        graph = next(
            (r.get("ms_median") for r in rows if r["mode"] == "hand_graph" and r["status"] == "ok"),
            None,
        )
        parts += ["", f"## {wl}", ""]
        h = headers if wl != "mixed" else headers[:3] + ["padding waste"] + headers[4:]
        if wl.startswith("ttft"):
            h = ["mode", "TTFT ms", "first tok/s", "x prefill eager"] + headers[4:]
        table = []
        for r in rows:
            if wl == "mixed":
                third = r.get("padding_waste")
            elif wl.startswith("ttft"):
                third = r.get("x_ttft_prefill_eager")
            else:
                third = r["ms_median"] / graph if graph and r.get("ms_median") else None
            table.append(
                [
                    r["mode"],
                    r.get("ms_median"),
                    r.get("tokens_per_s"),
                    third,
                    r.get("peak_mem_mib"),
                    r.get("capture_s"),
                    r.get("token_agreement"),
                    "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
                ]
            )
        parts.append(markdown_table(h, table))
    return "\n".join(parts)
