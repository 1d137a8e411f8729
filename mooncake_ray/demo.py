"""``make demo``: start an embedded Ray, deploy the store, run a short workload, and say
what happened. Run inside a private network namespace (the Makefile does that)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import mooncake_ray
    from mooncake_ray.cli import format_status

    import ray

    # A fresh embedded Ray: never attach to some other cluster this machine may run.
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    spill_dir = tempfile.mkdtemp(prefix="mooncake-ray-demo-spill-", dir=os.environ.get("DEMO_SPILL_DIR"))
    t0 = time.perf_counter()
    store = mooncake_ray.start({
        "segment_size_bytes": "64mb",          # a small DRAM pool, so the demo fills it
        "spill": {"enabled": True, "directory": spill_dir, "capacity_bytes": "256mb"},
        "transport": {"devices": ["lo"]},
    })
    print(f"store deployed in {time.perf_counter() - t0:.1f}s")

    n, size = 160, 1 << 20  # 160 MiB of values into a 64 MiB pool: offload to disk
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
    t0 = time.perf_counter()
    for i, v in enumerate(values):
        store.put(f"demo/{i}", v)
    dt = time.perf_counter() - t0
    print(f"put {n} x 1 MiB in {dt:.2f}s ({n * size / dt / 1e9:.2f} GB/s)")

    buf = np.empty(size, dtype=np.uint8)
    t0, ok, missing = time.perf_counter(), 0, 0
    for i, v in enumerate(values):
        try:
            store.get_into(f"demo/{i}", buf)
            ok += bool(np.array_equal(buf, v))
        except mooncake_ray.ObjectNotFoundError:
            missing += 1
    dt = time.perf_counter() - t0
    print(f"got {ok}/{n} back byte-exact ({missing} missing) in {dt:.2f}s "
          f"({ok * size / dt / 1e9:.2f} GB/s; older values came back from disk)")

    small = [f"small/{i}" for i in range(1000)]
    store.batch_put(small, [b"x" * 4096] * len(small))
    t0 = time.perf_counter()
    got = store.batch_get(small)
    dt = time.perf_counter() - t0
    print(f"batch_get of 1000 x 4 KiB: {dt * 1e3:.1f} ms ({sum(g is not None for g in got)} hits)")
    try:
        store.get("never-stored")
    except mooncake_ray.ObjectNotFoundError as e:
        print(f"a miss raises ObjectNotFoundError: {e}")

    print()
    print(format_status(store.stats()))
    store.close()
    chat_demo()
    mooncake_ray.shutdown(stop_ray=True)


def chat_demo(turns: int = 4) -> None:
    """The disaggregated Serve app (ingress -> prefill -> decode, KV through the store)
    and a short multi-turn chat over HTTP: per turn, time to first token and cached
    prompt tokens (the second turn on reuses the first turns' KV from the store)."""
    import json
    import socket

    import httpx
    from ray import serve

    from mooncake_ray.serve import build_app

    model = dict(model_id="mooncake-ray/demo", num_layers=8, num_kv_heads=4, head_dim=64, num_q_heads=4,
                 hidden=256, ffn=512, page_size=16, kv_dtype="bfloat16")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    t0 = time.perf_counter()
    serve.run(build_app({"mode": "disaggregated", "model": model, "handoff": "direct",
                         "transport": {"devices": ["lo"]},
                         "store": {"enabled": True, "namespace": "mooncake_ray"},
                         "prefill": {"num_replicas": 1, "engine": {"pool_pages": 512}},
                         "decode": {"num_replicas": 1, "engine": {"pool_pages": 512}}}),
              name="demo-chat", route_prefix="/")
    print(f"\ndisaggregated Serve app up in {time.perf_counter() - t0:.1f}s "
          f"(prefill -> decode: prompt KV written straight into the decode pool, and through to the store)")
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    questions = ["Explain why a KV cache makes LLM serving cheaper. " * 6, "What happens when DRAM runs out?",
                 "And how does prefill/decode disaggregation use the store?", "Summarise in one line."]
    messages = []
    print("(the reference model has random weights: its answers are noise, but exact and repeatable)")
    print(f"{'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>8}  answer tokens")
    for i, q in enumerate(questions[:turns]):
        messages.append({"role": "user", "content": q})
        body = {"model": model["model_id"], "messages": messages, "max_tokens": 24, "stream": True,
                "stream_options": {"include_usage": True}}
        t, ttft, text, usage = time.perf_counter(), None, [], {}
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage
                for c in ev["choices"]:
                    if ttft is None:
                        ttft = time.perf_counter() - t
                    text.append(c["delta"].get("content", ""))
        answer = "".join(text)
        messages.append({"role": "assistant", "content": answer})
        print(f"{i + 1:>4} {usage['prompt_tokens']:>10} {usage['prompt_tokens_details']['cached_tokens']:>10} "
              f"{ttft * 1e3:>8.1f}  {usage['completion_tokens']}")
    serve.delete("demo-chat")  # not serve.shutdown(): in Ray 2.60 its controller kills itself while
    # its own graceful_shutdown task is pending, and Ray logs that task as failed; stopping Ray
    # (mooncake_ray.shutdown) ends the controller and proxy


if __name__ == "__main__":
    main()
