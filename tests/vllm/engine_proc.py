"""A real vLLM engine in a process of its own, driven over stdin/stdout by the tests.

    python engine_proc.py '<json: model dir, kv_role or null, extra config, ...>'

or forked from ``zygote.py`` (what the tests do: vLLM is imported once), which calls ``main(spec)``.

Each stdin line is a JSON command; each answer is one stdout line ``MCR-RESULT <json>``
(vLLM logs go to stderr). Commands: ``generate`` (greedy; returns token ids and
``num_cached_tokens`` per prompt), ``reset`` (drops vLLM's own prefix cache, so the next
request can only reuse KV through the store), ``arm_master_kill`` (the next batched KV load
first kills the store's master: a fault injected mid-load), ``exit``.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): scheduler- and
worker-side connectors share this process and its store client, which is how vLLM runs a
single-device engine.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
for _k, _v in ENV_DEFAULTS.items():
    os.environ.setdefault(_k, _v)


def reply(obj) -> None:
    sys.__stdout__.write("MCR-RESULT " + json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def make_llm(spec: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = dict(model=spec["model"], dtype="bfloat16", enforce_eager=True, distributed_executor_backend="uni",
              block_size=spec.get("block_size", 32), max_model_len=spec.get("max_model_len", 2048),
              enable_prefix_caching=True, seed=0)
    kw.update(spec.get("llm", {}))  # e.g. a hybrid model's mamba_cache_mode
    if spec.get("kv_role"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="MooncakeRayConnector", kv_connector_module_path="mooncake_ray.integrations.vllm",
            kv_role=spec["kv_role"], kv_connector_extra_config=spec.get("extra", {}))
    return LLM(**kw)


def reset_prefix_cache(llm, timeout_s: float = 30.0) -> bool:
    """Drop vLLM's own prefix cache. A finished request whose saves were still running
    keeps its blocks until the engine's next step reports the saves done; the offline
    ``LLM`` steps only while it has requests, so step it until they are released."""
    import time

    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.02)
    return True


def arm_master_kill(namespace: str) -> None:
    """Wrap the worker's batched load so that its next call kills the master first."""
    import ray

    from mooncake_ray._private.naming import MASTER_NAME
    from mooncake_ray.integrations import _vllm_worker

    orig = _vllm_worker.KVTransfer._load

    def load_after_kill(self, runs, layers):
        _vllm_worker.KVTransfer._load = orig
        ray.kill(ray.get_actor(MASTER_NAME, namespace=namespace), no_restart=False)
        return orig(self, runs, layers)

    _vllm_worker.KVTransfer._load = load_after_kill


def arm_remove(marker: str) -> None:
    """Wrap the worker's batched load so that its next call first removes, from the store,
    the keys it is about to read whose name holds ``marker`` (a value gone between the
    lookup and the load)."""
    from mooncake_ray.integrations import _vllm_worker

    orig = _vllm_worker.KVTransfer._load

    def load_after_remove(self, runs, layers=None):
        _vllm_worker.KVTransfer._load = orig
        keys = [k for k in self._keys(runs)[0] if marker in k]
        for k in keys:
            self.client.remove(k)
        return orig(self, runs, layers)

    _vllm_worker.KVTransfer._load = load_after_remove


def main(spec: dict | None = None) -> None:
    spec = spec if spec is not None else json.loads(sys.argv[1])
    sys.stdout = sys.stderr  # keep stdout for answers
    try:
        llm = make_llm(spec)
    except BaseException as e:  # noqa: BLE001 - the test reads the error
        reply({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]})
        sys.exit(1)
    from vllm import SamplingParams

    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "generate":
                params = cmd.get("params") or [None] * len(cmd["prompts"])  # kv_transfer_params per prompt
                sps = [SamplingParams(max_tokens=cmd.get("max_tokens", 16), temperature=0.0, ignore_eos=True,
                                      logprobs=0 if cmd.get("logprobs") else None,
                                      extra_args={"kv_transfer_params": p} if p else None) for p in params]
                outs = llm.generate(cmd["prompts"], sps, use_tqdm=False)
                reply([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0,
                        "prompt_tokens": len(o.prompt_token_ids), "params": o.kv_transfer_params,
                        "logprobs": [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]
                        if cmd.get("logprobs") else None} for o in outs])
            elif op == "reset":
                reply(reset_prefix_cache(llm))
            elif op == "arm_remove":  # the next batched load first removes the stored keys holding this text
                arm_remove(cmd["marker"])
                reply(True)
            elif op == "arm_master_kill":
                arm_master_kill(cmd["namespace"])
                reply(True)
            elif op == "connector_stats":  # the worker side's running totals
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                reply(get_kv_transfer_group().transfer.stats)
            elif op == "device_stats":  # how the worker's KV memory moves, and the client's staging counts
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                t = get_kv_transfer_group().transfer
                reply({"path": t.path, **t.client.device_stats})
            elif op == "exit":
                reply(True)
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except BaseException as e:  # noqa: BLE001
            reply({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]})
    os._exit(0)  # vLLM's and Ray's threads would hold the process


if __name__ == "__main__":
    main()
