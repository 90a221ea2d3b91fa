"""The "KV memory" section of docs/BENCHMARKS.md, from `attnserve bench memory`'s result (bench/commands/memory.py)."""

from __future__ import annotations

import math

GiB, MiB = 2**30, 2**20


def ms(seconds: float | None) -> str:
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.0f} ms"


def sec(seconds: float | None, digits: int = 1) -> str:
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds:.{digits}f} s"


def gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GiB:.2f} GiB"


def render_section(r: dict, machine: str, shown) -> str:
    cpu = r.get("cpu", {})
    lines = ["## KV memory", "",
             f"On {machine}. `lscpu`: {cpu.get('model_name')}; `grep -o -w 'avx2\\|avx512f\\|avx512_vnni\\|avx_vnni\\|"
             f"amx_tile' /proc/cpuinfo | sort -u`: {', '.join(cpu.get('flags', []))}. Written by "
             "`attnserve bench memory` (bench/commands/memory.py); each part names the command that ran it. The "
             "machine is 2 cores shared with other work: read ratios measured in the same run."]
    if "mechanism" in r:
        lines += mechanism(r["mechanism"], shown)
    for part, title in (("server", "A server with no memory flags"), ("budget", "A server with a --memory-budget")):
        if r.get(part):
            lines += server(r[part], title, shown)
    if r.get("beside"):
        lines += beside(r["beside"], shown)
    if r.get("llama"):
        lines += llama(r["llama"], r, shown)
    if r.get("long-context"):
        lines += long_context(r["long-context"], shown)
    held = {**r.get("targets", {}), **r.get("checks", {})}
    if held:
        lines += ["", "### Checks", "", "| check | held |", "|---|---|"]
        lines += [f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in held.items()]
    return "\n".join(lines) + "\n"


def mechanism(m: dict, shown) -> list[str]:
    d, rel, s = m["decode"], m["release"], m["shape"]
    layouts = list(d["median_ms"])
    shape = (f"{s['layers']} layers, d_model {s['d_model']}, {s['heads']} heads, {s['kv_heads']} KV heads of "
             f"{s['d_head']}, vocabulary {s['vocab']}, context {s['context']}")
    out = ["", "### The mechanism, in-process", "",
           f"`{shown(m['command'])}`: bundle `{m['bundle']}` ({shape}), graph `{d['graph']}`.", "",
           f"Decode step at batch {d['batch']}, every row holding the context's positions (random keys and values), "
           f"slots of {d['slot_positions']} positions in both layouts, attached to the same runner. Each of "
           f"{d['rounds']} rounds runs the two layouts back to back per context ({d['steps']} timed steps each, their "
           "median); times are medians over rounds, the speed ratio the median of the rounds' ratios:", "",
           "| layout | " + " | ".join(f"context {c}" for c in d["contexts"]) + " |",
           "|---|" + "---|" * len(d["contexts"])]
    for layout in layouts:
        times = (f"{d['median_ms'][layout][str(c)]:.1f} ms" for c in d["contexts"])
        out.append(f"| {layout} | " + " | ".join(times) + " |")
    ratios = (f"**{d['speed_ratio'][str(c)]:.2f}**" for c in d["contexts"])
    out.append("| speed, now / before | " + " | ".join(ratios) + " |")
    per_pos = rel["bytes_per_position"]
    out += ["", f"A `KVCache` at the model's context ({rel['context']} positions a slot, {per_pos / 1024:.0f} KiB a "
            f"position): writing {rel['positions']} positions of a slot and releasing it (resident set of this "
            "process, /proc/self/statm; `KVCache.release` median of "
            f"{rel['rounds']} rounds):", "",
            "| | resident | change |", "|---|---|---|",
            f"| before | {rel['rss_before'] / MiB:.0f} MiB | |",
            f"| {rel['positions']} positions written | {rel['rss_written'] / MiB:.0f} MiB | "
            f"+{(rel['rss_written'] - rel['rss_before']) / MiB:.0f} MiB (the positions' keys and values: "
            f"{rel['expected_bytes'] / MiB:.0f} MiB) |",
            f"| released | {rel['rss_released'] / MiB:.0f} MiB | "
            f"{(rel['rss_released'] - rel['rss_written']) / MiB:+.0f} MiB |",
            "", f"`release` of that slot: **{rel['release_ms']:.2f} ms** (the pages given back, one `madvise` per "
            "head row); when the last slot's sequence, as long, moves into its place: "
            f"{rel['release_moved_ms']:.1f} ms (a copy of the moved prefix, then the pages)."]
    return out


def phase_row(name: str, ph: dict, preemptions: bool = True) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in ph["errors"].items()) or "0"
    running = ph.get("max_running")
    free = ph.get("min_free_kv_tokens")
    memory = f"{ph.get('preemptions', 0):.0f} | {'—' if free is None else f'{free:,}'} | " if preemptions else ""
    return (f"| {name} | {ph['completed']}/{ph['requests']} | {errors} | {'—' if running is None else running} | "
            + memory
            + f"{sec(ph['ttft_s']['p50'])} | {sec(ph['ttft_per_1k_s']['p50'], 2)} | "
            f"{sec(ph['ttft_per_1k_s']['p90'], 2)} | {sec(ph['wall_s'], 0)} |")


HEAD = ("| workload | completed | errors | most running | preemptions | least KV tokens free | TTFT p50 | "
        "TTFT per 1k prompt tokens p50 | p90 | wall |", "|---|---|---|---|---|---|---|---|---|---|")


def describe_phase(name: str, ph: dict) -> str:
    return f"{name} ({ph['requests']} prompts, {ph['prompt_tokens']:,} prompt tokens)"


def server(part: dict, title: str, shown) -> list[str]:
    out = ["", f"### {title}", "", f"`{shown(part['command'])}`. Each workload is submitted at once: (long) prompts of "
           "one length, 16 new tokens each; (mixed) lengths uniform in a range from a seed, 32 new tokens each; "
           "random token ids, all different. TTFT counts the queue behind the other prompts."]
    for run in part["runs"]:
        p = run["plan"]
        out += ["", f"`{shown(run['command'])}` served `{run['model']['name']}` with the `{run['model']['graph']}` "
                "graph: SERVING after "
                f"**{run['startup_s']:.1f} s**; peak RSS **{gib(run['peak_rss_bytes'])}** of a budget of "
                f"{gib(run['budget_bytes'])} ({'within' if run['within_budget'] else '**beyond**'}). Its log:", "",
                "```", str(p["budget_line"]), str(p["kv_line"]), "```", "", *beyond(run), *HEAD]
        out += [phase_row(describe_phase(name, ph), ph) for name, ph in run["phases"].items()
                if name != "long_beside_streams"]
    return out


def beyond(run: dict) -> list[str]:
    """The peak's part that is neither the model nor the most KV held, against the activation estimate."""
    if "peak_beyond_model_and_kv_bytes" not in run:
        return []
    p = run["plan"]
    # the prefix cache keeps each prompt's keys and values in blocks no sequence holds (free to `kv_free_tokens`):
    # at most every prompt token sent, within the KV cache's share of the budget
    prompts = sum(ph.get("prompt_tokens", 0) for name, ph in run["phases"].items() if name != "long_beside_streams")
    cached = min(prompts, p["kv_tokens"]) * p["kv_bytes_per_token"]
    return [f"At its peak the process held {gib(run['peak_beyond_model_and_kv_bytes'])} beyond the model as loaded "
            f"({p['model_gib']:.2f} GiB) and the most KV the sequences held ({gib(run['kv_held_max_bytes'])}, from "
            f"the least `kv_free_tokens` seen): the prefix cache's copies of the prompts, up to {gib(cached)} for "
            f"these {prompts:,} prompt tokens (all different), kept in blocks no sequence holds, inside the KV "
            f"cache's share; then the activations and the arenas, against the log's estimate of "
            f"{p['activations_gib']:.2f} GiB for the largest step at the full context.", ""]


def beside(part: dict, shown) -> list[str]:
    run = part["runs"][0]
    b = run["phases"]["long_beside_streams"]
    long, streams = b["long"], b["streams"]
    during, before = streams["itl_during_prefill_s"], streams["itl_before_s"]
    return ["", "### A long prompt beside decoding streams", "",
            f"`{shown(part['command'])}`: `{shown(run['command'])}` (`{run['model']['graph']}`; SERVING after "
            f"{run['startup_s']:.0f} s, peak RSS {gib(run['peak_rss_bytes'])} of {gib(run['budget_bytes'])}). "
            f"{streams['requests']} streams of 32-token prompts start; "
            f"once each has its first token, one {long['prompt_tokens']:,}-token prompt (16 new tokens) is sent"
            f"{'' if b.get('sent_while_streams_ran') else ' (**after a stream had ended**)'}. It "
            f"{'completed' if long['completed'] else '**did not complete**'}: TTFT **{sec(long['ttft_s']['p50'])}** "
            f"({sec(long['ttft_per_1k_s']['p50'], 2)} per 1k prompt tokens), at most "
            f"{b.get('max_running')} requests running, {b.get('preemptions', 0):.0f} preemptions. The streams "
            f"({streams['completed']}/{streams['requests']} completed):", "",
            "| streams' inter-token latency | messages | p50 | p99 | max |", "|---|---|---|---|---|",
            *(f"| {when} | {gaps['n']} | {ms(gaps['p50'])} | {ms(gaps['p99'])} | {ms(gaps['max'])} |"
              for when, gaps in (("before the long prompt", before), ("while it is prefilled", during))),
            "", "While it is prefilled each step runs one chunk of it (up to `max_batch_tokens` = 512 positions "
            "with the streams' rows): the streams' gap is that step, so the max above is the longest chunk's step."]


def llama(part: dict, r: dict, shown) -> list[str]:
    out = ["", "### llama.cpp's server on the same weights", ""]
    if part.get("skipped"):
        return out + [f"Skipped: {part['skipped']}."]
    v = part["versions"]
    out += [f"`{shown(part['command'])}`: `{part['server_command']}` (llama.cpp {v['llama.cpp']}), the GGUF "
            f"`{part['gguf']}` ({part['precision']} weights, its default f16 KV cache) converted from the same "
            f"Hugging Face directory by llama.cpp's converter. Its context, {part['context']:,} cells shared by "
            f"{part['slots']} slots (`--kv-unified`), is {part.get('context_source', 'given')}"
            + (" (capped at half the memory available)" if part["context"] < part["context_wanted"] else "")
            + f". Ready after **{part['startup_s']:.1f} s**; peak RSS **{gib(part['peak_rss_bytes'])}**. "
            f"Its log: {', '.join(f'{k} {v}' for k, v in part.get('log_facts', {}).items() if v)}. Most running = "
            "slots processing in `GET /slots`.", "",
            "| workload | completed | errors | most running | TTFT p50 | TTFT per 1k prompt tokens p50 | p90 | wall |",
            "|---|---|---|---|---|---|---|---|"]
    out += [phase_row(describe_phase(name, ph), ph, preemptions=False) for name, ph in part["phases"].items()]
    return out


def long_context(part: dict, shown) -> list[str]:
    out = ["", "### A 131,072-position model with no memory flags", ""]
    if part.get("skipped"):
        return out + [f"Skipped: {part['skipped']}."]
    run = part["runs"][0]
    p = run["plan"]
    ph = next(iter(run["phases"].values()))
    return out + [f"`{shown(part['command'])}`: `{shown(run['command'])}` (`{run['model']['name']}`, context "
                  f"{run['model']['context']:,}, graph `{run['model']['graph']}`) reached SERVING after "
                  f"**{run['startup_s']:.1f} s**; peak RSS **{gib(run['peak_rss_bytes'])}** of "
                  f"{gib(run['budget_bytes'])}. Its log:", "", "```", str(p["budget_line"]), str(p["kv_line"]), "```",
                  "", *beyond(run), f"One {ph['prompt_tokens']:,}-token prompt, 16 new tokens: "
                  f"{'completed' if ph['completed'] else '**not completed**'}"
                  f"{' (' + ', '.join(f'{k} {v}' for k, v in ph['errors'].items()) + ')' if ph['errors'] else ''}, "
                  f"TTFT {sec(ph['ttft_s']['p50'])} ({sec(ph['ttft_per_1k_s']['p50'], 2)} per 1k prompt tokens)."]
