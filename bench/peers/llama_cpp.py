"""llama.cpp as a peer of `attnserve bench compare`: `llama-server` over HTTP, and `llama-batched-bench`.

    make bench-llama-cpp        # builds the programs (cached under ~/.cache) and the converter's virtualenv
    python -m bench.peers.llama_cpp --hf-dir runs/hf --precision q8_0 --mode server --quick
    python -m bench.peers.llama_cpp --hf-dir runs/hf --precision q4_0 --mode batched-bench --spec spec.json

`available()` says why llama.cpp cannot run here (None when it can); `convert(hf_dir, work, precision)`
makes the GGUF; `measure(hf_dir, work, precision, spec, mode)` returns the peer protocol's result.

How it is built, run and measured, and the traps met on the way: docs/BENCHMARKS.md#how-llamacpp-is-run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2

from bench import workload
from bench.peers.protocol import peak_rss_bytes
from bench.stats import RequestRecord, percentile
from service.client.server_process import free_port, stop

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "bench" / "peers" / "build-llama-cpp.sh"
CONVERT_SCRIPT = ROOT / "bench" / "peers" / "llama_cpp_convert.py"
CONVERTER_PYTHON = ROOT / ".venv-llama-cpp" / "bin" / "python"
PROGRAMS = ("llama-server", "llama-batched-bench", "llama-quantize")
# precision as asked (llama.cpp's type names, or the protocol's) -> (llama.cpp type, the protocol's name)
PRECISIONS = {"f32": ("f32", "fp32"), "fp32": ("f32", "fp32"), "f16": ("f16", "f16"), "q8_0": ("q8_0", "q8_0"),
              "q4_0": ("q4_0", "q4_0")}
SLOTS = 32  # --parallel: the protocol's 32 streams, one slot each
CONTEXT_MARGIN = 16  # tokens per slot beyond prompt + new tokens
STARTUP_TIMEOUT_S = 120.0


def where() -> tuple[Path, Path]:
    """(the programs' folder, the llama.cpp source) as the build script names them; nothing is built."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--where"], capture_output=True, text=True, check=True)
    bin_dir, source = out.stdout.split("\n")[:2]
    return Path(bin_dir), Path(source)


def available() -> str | None:
    """None when the programs and the converter's virtualenv are there; else why not, in one line."""
    bin_dir, source = where()
    missing = [p for p in PROGRAMS if not (bin_dir / p).is_file()]
    if missing:
        return f"llama.cpp not built ({', '.join(missing)} missing): make bench-llama-cpp"
    if not (source / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is missing from {source}: make bench-llama-cpp"
    if not CONVERTER_PYTHON.is_file():
        return f"the converter's virtualenv {CONVERTER_PYTHON.parent.parent.name} is missing: make bench-llama-cpp"
    return None


def cores() -> int:
    return len(os.sched_getaffinity(0))


def llama_type(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: llama.cpp is measured at {', '.join(sorted(PRECISIONS))}")
    return PRECISIONS[precision][0]


def converter_input(hf_dir: Path, work: Path) -> Path:
    """`hf_dir`, or a linked copy with what the converter needs added: the `n_ctx` GPT-2's config lacks, and a
    tokenizer_config.json naming the plain fast tokenizer when there is none (the converter's transformers would
    otherwise load a Llama checkpoint's tokenizer.json as LlamaTokenizerFast, which adds <s>, </s> and <unk> past
    the end of the vocabulary)."""
    config = json.loads((hf_dir / "config.json").read_text())
    gpt2_ctx = config.get("model_type") == "gpt2" and "n_ctx" not in config
    bare_tokenizer = (hf_dir / "tokenizer.json").is_file() and not (hf_dir / "tokenizer_config.json").is_file()
    if not gpt2_ctx and not bare_tokenizer:
        return hf_dir
    local = work / f"{hf_dir.name}-converter"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    for f in hf_dir.iterdir():
        if f.name != "config.json":
            (local / f.name).symlink_to(f.resolve())
    (local / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]} if gpt2_ctx else config,
                                                  indent=2))
    if bare_tokenizer:
        (local / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return local


def run_logged(cmd: list[str], log: Path, what: str) -> None:
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}); the end of {log}:\n{log.read_text()[-3000:]}")


def convert(hf_dir: Path, work: Path, precision: str) -> Path:
    """The GGUF of `hf_dir` at `precision` (f32, f16, q8_0, q4_0), made once and kept in `work`."""
    kind = llama_type(precision)
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{hf_dir.name}-{kind}.gguf"
    if out.is_file():
        return out
    bin_dir, source = where()
    partial = out.with_suffix(".partial")  # renamed when whole: a failed run leaves nothing to reuse
    if kind == "q4_0":
        full = convert(hf_dir, work, "f32")
        run_logged([str(bin_dir / "llama-quantize"), str(full), str(partial), "Q4_0", str(cores())],
                   out.with_suffix(".log"), "llama-quantize")
    else:
        run_logged([str(CONVERTER_PYTHON), str(CONVERT_SCRIPT), str(source), str(converter_input(hf_dir, work)),
                    "--outfile", str(partial), "--outtype", kind], out.with_suffix(".log"), "convert_hf_to_gguf.py")
    partial.rename(out)
    return out


def versions(bin_dir: Path) -> dict:
    """llama.cpp's version and commit, and the sdist its source came from."""
    text = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True).stderr
    found = re.search(r"version: (\S+) \(build \d+, commit (\w+)\)", text)
    build = f"{found.group(1)}, commit {found.group(2)}" if found else text.strip().splitlines()[0]
    sdist = bin_dir.parent.name.split("-")[1]  # llama.cpp-<sdist version>-<cpu>
    return {"llama.cpp": build, "llama-cpp-python sdist": sdist}


def context_per_sequence(spec: dict) -> int:
    prompts = spec["single"] + spec["streams"]
    return max(len(p) for p in prompts) + spec["new_tokens"] + CONTEXT_MARGIN


def request_body(prompt: list[int], new_tokens: int, stream: bool, cache_prompt: bool = False) -> dict:
    """Exactly `new_tokens` greedy tokens after `prompt` (ids, so no BOS), no penalties; prefilled whole unless
    `cache_prompt` lets the server reuse a slot's cached prefix of it."""
    return {"prompt": prompt, "n_predict": new_tokens, "ignore_eos": True, "samplers": ["top_k"], "top_k": 1,
            "temperature": 0.0, "repeat_penalty": 1.0, "cache_prompt": cache_prompt, "stream": stream,
            "return_tokens": not stream}


def check_final(final: dict | None, new_tokens: int) -> None:
    if final is None:
        raise RuntimeError("llama-server's stream ended without its final chunk")
    if final.get("stop_type") != "limit" or final.get("tokens_predicted") != new_tokens:
        raise RuntimeError(f"llama-server stopped after {final.get('tokens_predicted')} of {new_tokens} tokens "
                           f"(stop_type {final.get('stop_type')!r})")


class Completions:
    """llama-server's `POST /completion` over one httpx2 client with `n` keep-alive connections, opened
    before it is used (before the clock starts). Now and then the server closes a kept-alive connection
    just as a request goes out on it, which then fails before any response ("Server disconnected without
    sending a response"): such a request is sent once more, from its first send time, and counted."""

    def __init__(self, http: httpx2.AsyncClient):
        self.http = http
        self.retried = 0  # requests sent again on a fresh connection

    @classmethod
    @contextlib.asynccontextmanager
    async def connected(cls, url: str, n: int):
        limits = httpx2.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=httpx2.Timeout(600.0)) as http:
            for response in await asyncio.gather(*(http.get("/health") for _ in range(n))):
                response.raise_for_status()
            yield cls(http)

    async def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        """One request, not streamed: its generated ids."""
        body = request_body(prompt, new_tokens, stream=False)
        try:
            response = await self.http.post("/completion", json=body)
        except httpx2.RemoteProtocolError:
            self.retried += 1
            response = await self.http.post("/completion", json=body)
        response.raise_for_status()
        data = response.json()
        check_final(data, new_tokens)
        return data["tokens"]

    async def stream(self, prompt: list[int], new_tokens: int, cache_prompt: bool = False) -> RequestRecord:
        """One streamed request: each chunk's arrival and the tokens generated since the previous chunk."""
        record = RequestRecord(time.perf_counter(), expected_tokens=new_tokens)
        body = request_body(prompt, new_tokens, stream=True, cache_prompt=cache_prompt)
        try:
            final = await self._stream(body, record)
        except httpx2.RemoteProtocolError:
            if record.arrivals:
                raise
            self.retried += 1
            final = await self._stream(body, record)
        check_final(final, new_tokens)
        return record

    async def _stream(self, body: dict, record: RequestRecord) -> dict | None:
        seen, final = 0, None
        async with self.http.stream("POST", "/completion", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"llama-server answered {response.status_code}: {(await response.aread())[:500]!r}")
            async for event in httpx2.EventSource(response):
                now = time.perf_counter()
                if event.data == "[DONE]":
                    continue
                data = json.loads(event.data)
                if "error" in data:
                    raise RuntimeError(f"llama-server: {data['error']}")
                if data.get("tokens_predicted", 0) > seen:  # a chunk held back for UTF-8 is counted in the next
                    record.arrived(now, data["tokens_predicted"] - seen)
                    seen = data["tokens_predicted"]
                if data.get("stop"):
                    final = data
        return final


async def drive(url: str, spec: dict) -> tuple[list[list[int]], list[list[int]], dict, dict, int]:
    """The warm-up (the streams at once, then the batch-1 prompts in turn: the result's tokens and
    single_tokens), then per repeat the batch-1 prompts in turn and the streams at once: (tokens,
    single_tokens, single, streams) as the protocol has them, and the requests retried. Each phase opens
    its connections anew: the server closes a connection that idles for 5 s."""
    n, prompts = spec["new_tokens"], spec["streams"]
    single = {"tokens_per_s": [], "ttft_s": []}
    many = {"n": len(prompts), "tokens_per_s": [], "ttft_p50_s": [], "ttft_p99_s": []}
    retried = 0
    async with Completions.connected(url, len(prompts)) as client:
        tokens = await asyncio.gather(*(client.generate(p, n) for p in prompts))
        single_tokens = [await client.generate(p, n) for p in spec["single"]]
        retried += client.retried
    for _ in range(spec["repeats"]):
        async with Completions.connected(url, 1) as client:
            records = [await client.stream(p, n) for p in spec["single"]]
            retried += client.retried
        single["tokens_per_s"].append(n * len(records) / sum(r.e2e for r in records))
        single["ttft_s"].append(statistics.median(r.ttft for r in records))
        async with Completions.connected(url, len(prompts)) as client:
            records = await asyncio.gather(*(client.stream(p, n) for p in prompts))
            retried += client.retried
        elapsed = max(r.end for r in records) - min(r.sent for r in records)
        ttfts = [r.ttft for r in records]
        many["tokens_per_s"].append(n * len(records) / elapsed)
        many["ttft_p50_s"].append(percentile(ttfts, 50))
        many["ttft_p99_s"].append(percentile(ttfts, 99))
    return list(tokens), single_tokens, single, many, retried


class LlamaServer:
    """`llama-server` in a child process on a free port, its log in a file; ready once /health says so."""

    def __init__(self, bin_dir: Path, gguf: Path, context: int, threads: int, log: Path,
                 extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "--parallel", str(SLOTS), "--cont-batching", "-c", str(context), "--threads", str(threads),
                     "--threads-batch", str(threads), "--no-ui", *extra]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting; the end of "
                                   f"{self.log}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx2.get(f"{self.url}/health", timeout=1.0).status_code == 200:  # 503 while it loads
                    return self
            except httpx2.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server was not ready after {STARTUP_TIMEOUT_S:.0f} s; log: {self.log}")

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes(self.proc.pid)

    def __exit__(self, *exc) -> None:
        stop(self.proc)


def measure_server(bin_dir: Path, gguf: Path, spec: dict, threads: int, work: Path) -> dict:
    context = context_per_sequence(spec) * SLOTS
    with LlamaServer(bin_dir, gguf, context, threads, work / f"{gguf.stem}-server.log") as server:
        tokens, single_tokens, single, streams, retried = asyncio.run(drive(server.url, spec))
        peak = server.peak_rss_bytes()
    slot = re.search(r"n_ctx_slot = (\d+)", server.log.read_text())  # as it sized them: padded, capped at training
    settings = {"threads": threads, "threads_batch": threads, "parallel": SLOTS, "cont_batching": True,
                "ctx_size": context, "ctx_per_slot": int(slot.group(1)) if slot else None,
                "flash_attn": "auto (default)",
                "batch / ubatch": "2048 / 512 (defaults)", "gguf": gguf.name,
                "request": request_body(["ids"], spec["new_tokens"], stream=True),
                "client": "POST /completion streamed (SSE), httpx2, one keep-alive connection per stream",
                "ttft": "send to the first chunk that carries a token",
                "warm_up": "the streams' prompts at once, then the batch-1 prompts one by one, not streamed; "
                           "their ids are `tokens` and `single_tokens`",
                "retried": retried,  # requests sent again: the server closed their kept-alive connection
                "command": " ".join(Path(a).name if a.startswith("/") else a for a in server.args)}
    return {"system": "llama.cpp server", "settings": settings, "single": single, "streams": streams,
            "tokens": tokens, "single_tokens": single_tokens, "peak_rss_bytes": peak}


def run_batched_bench(cmd: list[str], log: Path) -> tuple[list[dict], int]:
    """llama-batched-bench's JSONL rows in order, and the peak RSS of its process."""
    rows_file = log.with_suffix(".jsonl")
    with rows_file.open("w") as rows_out, log.open("w") as log_out:
        proc = subprocess.Popen(cmd, stdout=rows_out, stderr=log_out, stdin=subprocess.DEVNULL)
        peak = 0  # its VmHWM, read while it runs: ru_maxrss would count the memory of this process it forked from
        while proc.poll() is None:
            peak = max(peak, peak_rss_bytes(proc.pid))
            time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({proc.returncode}); the end of {log}:\n"
                           f"{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.startswith("{")]
    return rows, peak



def batched_bench_rows(cmd: list[str], log: Path, batches: tuple[int, ...], attempts: int = 10) -> tuple[dict, int]:
    """The first row of each of `batches`, and the peak RSS. llama.cpp logs from a thread of its own and
    may exit before that thread prints the last lines (its log.cpp says so), so `cmd` ends with one more
    batch whose row may be lost, and a run that still lost a row is run again: from the third attempt
    with `--poll 0`, so that its compute threads do not spin and the log thread gets a core."""
    for attempt in range(attempts):
        rows, rss = run_batched_bench(cmd + (["--poll", "0"] if attempt >= 2 else []), log)
        found = {b: next((row for row in rows if row["pl"] == b), None) for b in batches}
        if all(found.values()):
            return found, rss
    raise RuntimeError(f"llama-batched-bench printed rows for batches {[row['pl'] for row in rows]} of {batches}, "
                       f"{attempts} times; log: {log}")


def measure_batched_bench(bin_dir: Path, gguf: Path, spec: dict, threads: int, work: Path) -> dict:
    n, b = spec["new_tokens"], len(spec["streams"])
    if n < 2:
        raise ValueError("llama-batched-bench needs at least 2 new tokens (the prefill makes the first)")
    pp = round(statistics.mean(len(p) for p in spec["single"] + spec["streams"]))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(b * (pp + n)), "-npp", str(pp),
           "-ntg", str(n - 1), "-npl", f"1,{b},1", "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    single = {"tokens_per_s": [], "ttft_s": None, "s_tg_tokens_per_s": []}
    streams = {"n": b, "tokens_per_s": [], "ttft_p50_s": None, "ttft_p99_s": None, "s_tg_tokens_per_s": []}
    peak = 0
    for _ in range(spec["repeats"]):
        by_batch, rss = batched_bench_rows(cmd, work / f"{gguf.stem}-batched-bench.log", (1, b))
        peak = max(peak, rss)
        for batch, out in ((1, single), (b, streams)):
            out["tokens_per_s"].append(batch * n / by_batch[batch]["t"])
            out["s_tg_tokens_per_s"].append(by_batch[batch]["speed_tg"])
    settings = {"threads": threads, "threads_batch": threads, "ctx_size": b * (pp + n), "npp": pp, "ntg": n - 1,
                "npl": f"1,{b} (and a last 1, whose row may be lost)", "flash_attn": "auto (default)",
                "gguf": gguf.name,
                "tokens_per_s": f"B × {n} / (T_PP + T_TG): generated tokens over prefill + decode; the prefill "
                                f"yields the first token, so -ntg {n - 1}",
                "s_tg_tokens_per_s": f"its S_TG: B × {n - 1} / T_TG, decode only",
                "prompts": f"random ids, {pp} per sequence (its own; not the spec's ids)",
                "ttft": None, "warm_up": "its own (one 16-token batch before timing)",
                "retries": "a run whose rows llama.cpp's log thread lost is run again, from the third time with "
                           "--poll 0",
                "command": " ".join(Path(a).name if a.startswith("/") else a for a in cmd)}
    return {"system": "llama.cpp batched-bench", "settings": settings, "single": single, "streams": streams,
            "tokens": None, "single_tokens": None, "peak_rss_bytes": peak}


def measure(hf_dir: Path, work: Path, precision: str, spec: dict, mode: str) -> dict:
    """The peer protocol's result for llama.cpp at `precision`, `mode` "server" or "batched-bench"."""
    if mode not in ("server", "batched-bench"):
        raise ValueError(f"mode {mode!r}: server or batched-bench")
    gguf = convert(hf_dir, work, precision)
    bin_dir, _ = where()
    run = measure_server if mode == "server" else measure_batched_bench
    result = run(bin_dir, gguf, spec, cores(), work)
    return {"system": result.pop("system"), "precision": PRECISIONS[precision][1], **result,
            "versions": versions(bin_dir)}


def default_spec(vocab: int, quick: bool, seed: int = 0) -> dict:
    """16-token prompts (8 with `quick`), 128 new tokens (8), 32 streams and, as `bench.commands.compare` has them,
    their first 3 prompts (2) for batch 1."""
    prompt_tokens, new_tokens, singles = (8, 8, 2) if quick else (16, 128, 3)
    ids = [item.prompt for item in workload.fixed(SLOTS, prompt_tokens, new_tokens, vocab, seed)]
    return {"new_tokens": new_tokens, "single": ids[:singles], "streams": ids, "repeats": 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.llama_cpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", type=Path, required=True, help="the model as `attnserve export-hf` writes it")
    p.add_argument("--precision", default="q8_0", choices=sorted(PRECISIONS))
    p.add_argument("--mode", default="server", choices=["server", "batched-bench"])
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "llama-cpp", help="GGUFs and logs (one per model)")
    p.add_argument("--spec", type=Path, help="a run spec (JSON, the peer protocol's); default: random prompts")
    p.add_argument("--quick", action="store_true", help="without --spec: 8-token prompts, 8 new tokens, seconds")
    p.add_argument("--out", type=Path, help="write the result here (with the token ids)")
    args = p.parse_args(argv)
    reason = available()
    if reason:
        print(f"llama.cpp: skipped: {reason}", file=sys.stderr)
        return 2
    if args.spec:
        spec = json.loads(args.spec.read_text())
    else:
        spec = default_spec(json.loads((args.hf_dir / "config.json").read_text())["vocab_size"], args.quick)
    result = measure(args.hf_dir, args.work, args.precision, spec, args.mode)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    shown = {k: v for k, v in result.items() if k not in ("tokens", "single_tokens")}
    print(json.dumps(shown, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
