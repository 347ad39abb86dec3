"""Render docs/benchmarks.md from the benchmarks' results files in benchmarks/.

    python tools/bench_docs.py          # rewrite the page from benchmarks/*.json
    python tools/bench_docs.py --check  # exit 1 when the page is not what the files give

The page is generated: edit the prose here (``SECTIONS``) and the numbers by
re-running the tools (``tools/bench_all.py``), never the page itself. A test
checks that the page matches the files.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from bench_results import Results, Table  # noqa: E402

RESULTS = ROOT / "benchmarks"
PAGE = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Section:
    title: str
    measures: str  # what the tool measures and how to read its table: Markdown, wrapped


SECTIONS: dict[str, Section] = {
    "bench_engine": Section("The engine against a bare transformers loop", """\
The engine under C concurrent callers, each encoding single images from one list, against a
bare loop of the same checkpoint's image processor and vision tower (`visual(pixel_values,
grid_thw=...)` under `inference_mode`, as `get_image_features` calls it) on the same images:
once in groups of exactly the batch sizes the engine ran, and at fixed batch sizes 1 and
`max_batch_size`. `engine/best bare` holds the engine to the best of those (target: at least
0.95); the engine's outputs are checked against the bare loop's. The engine runs with default
settings, as a program that embeds it does: `1st pass/best bare` includes the learning of the
batch cap, `engine/best bare` runs with what was learned, `cap tok` is the learned cap and
`fixed/best bare` an engine with `adaptive_batch=False` ([Batching](batching.md)). `--quick`
uses a small vision tower (depth 8, hidden 640); without it the tower has Qwen2.5-VL-7B's
dimensions (random weights, bfloat16)."""),
    "bench_service": Section("The service against the engine", """\
One trio program serves an encoder (HTTP and gRPC on port 0) and calls it through the
receiver library, httpx and a gRPC channel, beside the *same* engine the server wraps, so
the difference is the service path alone. The first table is the added latency of
sequential single images on the embedded tiny model: `service` is the receiver library
(HTTP request, embedding back over ZMQ into its pool), `inline` a `POST /encode` with the
safetensors answer, `grpc` the native `Encode` with an inline answer (target: service p50
no more than 3 ms above the engine's). The throughput tables run C concurrent callers on
`bench_engine`'s quick vision tower (target: service at least 0.9 x the engine's
images/s), and the engine, inline HTTP and gRPC taking turns at C = 16."""),
    "bench_capacity": Section("Capacity: images per second and CPU per image", """\
An `epd-trio encoder` subprocess (the embedded tiny model) under load from a separate
process: C keep-alive HTTP clients, one image per `/encode` as a base64 data URI, inline
answers, for JPEG and PNG at several sizes, against `--preprocess-workers`. With
`--null-forward` the encoder answers zeros of the model's shape, so everything but the model
is measured. CPU columns are milliseconds per image on the server: `cpu` the whole process,
`trio` the trio thread (HTTP, JSON, base64, the service, scheduling), `pre` and `fwd` the
preprocessing and device threads (measured inside them), `zmq` libzmq's threads, `grpc`
grpcio's, `other` the rest. `cores` and `load` are the CPU seconds per second of the server
and of the load generator: where they add up to the machine's cores, more workers cannot
help. Columns marked `*` are timed alone in the benchmark process. Other work on the machine
moves images/s far more than the CPU columns."""),
    "bench_preprocess": Section("Preprocessing: threads against processes", """\
Decode plus the checkpoint's image processor only (no forward, no HTTP), with `2 x workers`
concurrent callers: `thread` is `--preprocess-mode thread`, `process` is `--preprocess-mode
process` (spawned children, tensors back through shared memory). The configurations take
turns case by case; each cell is the median of its rounds. The decode columns time PIL
against the default decoder (torchvision's libjpeg-turbo for JPEG; PNG goes through PIL in
both). The CPU table counts the encoder process and the pool's children, which other work
on the machine moves far less than the rates."""),
    "bench_production": Section("Embedding cache and data parallel", """\
Two production settings. The embedding cache (`--cache-mb`): each image encoded twice in a
row, through the engine and over HTTP; the first time is a miss (fetch, preprocess,
forward), the second a hit. Data parallel: one device worker against two (`--device cpu`
against `cpu,cpu`, or two GPUs), C concurrent callers; on a CPU both share the same cores,
so two workers are for hosts with several devices."""),
    "bench_transfer": Section("Moving an embedding: ZMQ, Mooncake, a raw socket", """\
One bfloat16 embedding per size moved in this process by each method, side by side: a
`memcpy` (the ceiling), a raw loopback TCP socket (the reference: the `x raw` ratios), the
encoder's ZMQ path over TCP and IPC (1 MiB payload frames, zero-copy), ZMQ with every send
watched until libzmq releases it, ZMQ with the whole tensor in one frame, ZMQ plus the
client's copy into its pool slot, and the Mooncake transfer engine over TCP (the same engine
under trio and bare). Target: ZMQ and Mooncake over TCP at least 0.8 x the raw socket. The
second table is the trio thread's CPU per message; the third counts the encoder side's
copies by resident memory (0 means none; the control row clones once per send)."""),
    "bench_loop_stall": Section("Event-loop stall of a large inline answer", """\
The longest gap between turns of a task that only yields, while one large float32 inline
answer (a safetensors body) is built on the trio thread (`on loop`) or, as the encoder does
from 1 MiB up, in a worker thread (`off loop`). Off the loop the stall is not zero: the
thread shares the GIL, and the copy into the body holds it."""),
    "bench_grpc_guard": Section("What the gRPC decode guard costs", """\
`DecodeGuard`, the interceptor that turns bytes that are not a method's message into
`INVALID_ARGUMENT`, runs on every call of every gRPC method. In process: each step it adds,
against the bare step. End to end: `grpc.health.v1.Health/Check` from a blocking client to
a server process with and without the guard, the servers taking turns."""),
    "probe_grpc": Section("Ways to serve gRPC from trio", """\
The same trio functions served by each candidate in a spawned server process and driven by
grpcio clients: unary latency, calls per second of 16 `grpc.aio` clients and the server's
CPU per call, whether a client cancel and an expired deadline reach the call's trio task,
and whether a health `Watch` stream works and ends. The encoder uses candidate A: grpcio's
`grpc.aio` server on a thread of its own, each call a trio task. D (trio-asyncio) and E
(purerpc) need packages outside the project's environment and are run on request
(`--candidates`)."""),
    "chaos_soak": Section("Chaos soak", """\
Not a speed measure: the real-clock chaos scenarios (client timeouts, dropped connections,
`/abort` at random times, an encoder SIGKILLed mid-batch and restarted, a ZMQ receiver that
stops reading) run against a registry and encoders in subprocesses, beside clean traffic to
a clean encoder, for `--duration` seconds. Hangs, leaks and 5xx answers caused by client
faults must be 0 (the tool exits 1 otherwise)."""),
    "bench_epd": Section("Time to first token: vLLM alone against EPD",
                         """A vLLM 0.32 server (its CPU build, an EC consumer of a shared directory) and epd_trio
encoders (`--api vllm`) in processes of their own. Streamed chat requests, each with 1, 4 or
8 new images (random pixels: no cache answers), go to vLLM alone (it encodes them itself)
and through `epd-trio proxy` to the same vLLM with 1, 2 and 4 encoders; the setups take
turns. TTFT runs from sending a request to the first streamed token; the ratios are each
EPD setup's TTFT over vLLM alone's with the same images (below 1: EPD is faster). The model
is a tiny random-weight Qwen2.5-VL; where the encoders share the machine's cores with vLLM,
EPD can only add its hops."""),
}

HEAD = """\
# Benchmarks

<!-- Generated by tools/bench_docs.py from benchmarks/*.json: edit those, not this page. -->

Each benchmark is a script under `tools/` that prints its tables and, with
`--results FILE`, writes them with the command, the date and the machine. This page is
generated from those files (`benchmarks/*.json`) by `tools/bench_docs.py`; a test checks
that it matches them. Benchmarks report, they never assert: speed and memory targets live
here, not in timed unit tests.

To measure again, on your hardware, and regenerate this page:

```bash
python tools/bench_all.py --quick   # every tool's quick mode; without --quick: full runs
python tools/bench_all.py --only bench_transfer --host-note "quiet, 16 cores"
```

Read every figure with its machine line: on a machine shared with other work, rates move with
the load; CPU-time columns move far less. `tools/gpu_check.sh` runs the engine, service,
production, preprocessing, capacity and transfer benchmarks on a CUDA machine
(see [Development](development.md#the-gpu-check)).
"""


def host_line(results: Results) -> str:
    h = results.host
    parts = [h.get("cpu", "unknown CPU"), f"{h.get('usable_cores')} of {h.get('cores')} cores usable"
             if h.get("usable_cores") != h.get("cores") else f"{h.get('cores')} cores"]
    if h.get("memory_gib"):
        parts.append(f"{h['memory_gib']:g} GiB")
    parts.append("GPU: " + h.get("gpu", "none"))
    parts.append(f"Python {h.get('python')}")
    line = ", ".join(parts)
    line += f"; load average {h.get('load_before')} at the start, {h.get('load_after')} at the end"
    if note := h.get("note"):
        line += f"; {note}"
    return line


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or " "


def render_table(table: Table) -> str:
    lines = [f"**{table.title}**", "", "| " + " | ".join(cell(h) for h in table.header) + " |",
             "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table.rows]
    if table.note:
        lines += ["", textwrap.fill(table.note.replace("*", "\\*"), width=96, break_on_hyphens=False)]
    return "\n".join(lines)


def render(results: dict[str, Results]) -> str:
    """The whole page: the head, then one section per tool in ``SECTIONS`` order."""
    out = [HEAD]
    for tool, section in SECTIONS.items():
        out.append(f"## {section.title}\n")
        out.append(f"{section.measures}\n")
        r = results.get(tool)
        if r is None:
            out.append("Not measured yet: run `python tools/bench_all.py --only " + tool + "`.\n")
            continue
        out.append(f"```bash\n{r.command}\n```\n")
        out.append(textwrap.fill(f"Measured {r.started} on {host_line(r)}.", width=96,
                                 break_on_hyphens=False) + "\n")
        out.extend(render_table(t) + "\n" for t in r.tables)
    return "\n".join(out).rstrip() + "\n"


def load(directory: Path) -> dict[str, Results]:
    found = {path.stem: Results.from_json(path.read_text()) for path in sorted(directory.glob("*.json"))}
    unknown = sorted(set(found) - set(SECTIONS))
    if unknown:
        raise ValueError(f"results for tools the page does not describe: {unknown}")
    return found


def write_page(directory: Path = RESULTS, page: Path = PAGE) -> None:
    page.write_text(render(load(directory)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the page is current")
    args = parser.parse_args(argv)
    text = render(load(RESULTS))
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python tools/bench_docs.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
