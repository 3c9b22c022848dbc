"""The fuzzer's mutations of the files a scenario points at (`benchmarks/fuzz.py`): a Hugging Face config, a
workload file, a profiler trace, a hardware profile, each a shipped one mutated (or not a file of its kind)."""

from __future__ import annotations

import copy
import json
import math

import yaml

from fuzz_values import HF_CONFIGS, PROFILES, TRACE_FIXTURE, TRACED, Raw, dump, mutate_tree, nasty, nest


def m_hf(rng, case):
    """model: {hf_config: cfg.json}, a shipped config mutated (or not JSON at all)."""
    source = rng.choice(HF_CONFIGS)
    config = json.loads(source.read_text())
    r = rng.random()
    if r < 0.6:
        notes = mutate_tree(rng, config, rng.choice([1, 1, 2, 3]), json_ok=True)
        text = dump(config, "json")
    elif r < 0.75:
        key = rng.choice(["num_hidden_layers", "hidden_size", "num_local_experts", "num_experts", "vocab_size",
                          "intermediate_size", "num_attention_heads", "image_size", "patch_size", "num_labels",
                          "num_experts_per_tok", "num_key_value_heads", "head_dim", "max_position_embeddings"])
        value = rng.choice([2147483648, 10**39, 1e39, 2**63, 1e300, 2.0, 64.5, 0, -3, True, "32", None, 10**6])
        target = config.get("text_config") if "text_config" in config and rng.random() < 0.5 else config
        target[key] = value
        notes = [f"{key}={value!r}"]
        text = dump(config, "json")
    else:
        text = rng.choice(["", "{", "[1, 2]", "null", "model_type: llama\n", "\xff\xfe{}", nest(100_000),
                           '{"model_type": "llama", "a": ' + nest(5000) + "}", "NaN", '{"model_type": NaN}',
                           '{"model_type": ["llama"]}', '{"model_type": {"a": 1}}'])
        notes = [f"text {text[:30]!r}"]
    name = rng.choice(["cfg.json", "config.json", "sub/config.json", "a\nb.json", "c" * 300 + ".json"])
    case.files[name] = text.encode("utf-8", "surrogatepass") if r < 0.75 or not text.startswith("\xff") \
        else b"\xff\xfe{}"
    case.data["model"] = {"hf_config": name}
    if rng.random() < 0.2:
        case.data["model"]["preset"] = "gpt2"
    case.notes.append(f"hf_config {source.name}: {notes}")


_TINY_WORKLOAD: dict | None = None


def _tiny_workload() -> dict:
    global _TINY_WORKLOAD
    if _TINY_WORKLOAD is None:
        from fsdp_sim.workload import TransformerDims, build_transformer

        wl = build_transformer(TransformerDims(hidden=64, layers=2, heads=4, vocab=256), micro_batch=1, seq_len=32,
                               act_dtype="bf16", name="tiny")
        _TINY_WORKLOAD = json.loads(json.dumps(wl.to_dict()))  # tuples as lists
    return copy.deepcopy(_TINY_WORKLOAD)


def _many_modules(data: dict, count: int, fmt: str) -> str:
    """`dump` of `data` with `count` copies of its second module (named layers.i, no parameters) put first.

    The copies differ only in their names, so one copy's text is repeated: dumping thousands of copies
    took 7 s (1,000) to 38 s (5,000) of the test's time, this the same bytes in milliseconds. The copies'
    names are one plain scalar each and the dump never wraps (width 10**9), so a copy's text does not
    depend on its name: A + name0 + B + name1 + C becomes A + name0 + B + name1 + B + ... + C.
    """
    modules = data["modules"]
    marks = ["__COPY0__", "__COPY1__"]
    copies = [copy.deepcopy(modules[1]) | {"name": m, "params": []} for m in marks]  # no shared parts: no YAML anchors
    text = dump(dict(data, modules=copies + modules), fmt)
    head, rest = text.split(marks[0])
    between, tail = rest.split(marks[1])
    return head + between.join(f"layers.{i}" for i in range(count)) + tail


def m_workload(rng, case):
    """model: {workload: wl.yaml}, the tiny model's workload mutated."""
    data = _tiny_workload()
    r = rng.random()
    notes: list = []
    if r < 0.5:
        notes = mutate_tree(rng, data, rng.choice([1, 1, 2]), json_ok=False)
    elif r < 0.8:
        m = rng.choice(data["modules"])
        key = rng.choice(["saved_bytes", "fwd_temp_bytes", "output_bytes", "fwd_flops", "bwd_flops", "fwd_time_s",
                          "bwd_time_s", "fwd_hbm_bytes"])
        value = rng.choice([2**63, 2**70, 1e300, math.inf, math.nan, 1e-12, 0.0, 2.0, 10**15, -1, 1.5])
        m[key] = value
        notes = [f"{m['name']}.{key}={value!r}"]
        if rng.random() < 0.3:
            data["model_flops"] = rng.choice([1e300, 1e30, 1e20, math.inf, 0.0])
            notes.append(f"model_flops={data['model_flops']}")
        if rng.random() < 0.3 and m["params"]:
            m["params"][0]["shape"] = rng.choice([[2**40, 2**40], [10**20], [2**31, 2**31, 2**31], [64.0, 64],
                                                  [0], [], [-1, 4], [1] * 1000])
            notes.append(f"shape={m['params'][0]['shape']!r:.40}")
    else:
        count = rng.choice([1000, 5000])
        notes = [f"{count + len(data['modules'])} modules"]
    fmt = rng.choice(["yaml", "yaml", "json"])
    name = f"wl.{fmt}"
    case.files[name] = _many_modules(data, count, fmt) if r >= 0.8 else dump(data, fmt)
    case.data["model"] = {"workload": name}
    training = case.data.get("training")
    if isinstance(training, dict) and rng.random() < 0.9:
        training.pop("micro_batch", None)
        training.pop("seq_len", None)
    case.notes.append(f"workload {notes}")


def m_trace(rng, case):
    """compute.trace: the fixture trace with malformed events."""
    case.data = copy.deepcopy(TRACED) if rng.random() < 0.7 else case.data
    trace = json.loads(TRACE_FIXTURE.read_text())
    events = trace["traceEvents"]
    notes = []
    for _ in range(rng.choice([1, 2, 3])):
        r = rng.random()
        e = rng.choice(events)
        if r < 0.3:
            key = rng.choice(["args", "pid", "tid", "name", "cat", "ph"])
            e[key] = rng.choice([5, "x", [], [1], {"a": 1}, None, {"correlation": [1]}, {"correlation": {"a": 1}},
                                 1.5, math.nan, True])
            notes.append(f"event.{key}={e[key]!r}")
        elif r < 0.5:
            key = rng.choice(["ts", "dur"])
            e[key] = rng.choice([math.nan, math.inf, -1.0, 1e300, -1e300, 0, 1e-300, 2**70, True])
            notes.append(f"event.{key}={e[key]!r}")
        elif r < 0.65:
            scale = rng.choice([1e-6, 1e-9, 1e-3, 1e6, 0.0])
            for ev in events:
                ev["dur"] = ev["dur"] * scale
            notes.append(f"dur x {scale}")
        elif r < 0.75:
            e["args"] = {"correlation": rng.choice([1, "1", 1.0, None])}
            e["cat"] = rng.choice(["kernel", "cuda_runtime"])
            e["dur"] = rng.choice([1e-9, 1e12, 5.0])
            notes.append(f"kernel event {e}")
        elif r < 0.85:
            trace = rng.choice([events, {"traceEvents": {"a": 1}}, {"traceEvents": None}, [], 5, "x",
                                {"traceEvents": [5, "x", None, [1]]}])
            notes.append(f"trace {str(trace)[:30]}")
            break
        else:
            e["name"] = rng.choice(["fsdp_sim::::forward", "fsdp_sim::layers.0::backward", "nn.Module: A_1",
                                    "fsdp_sim::a\nb::forward", 5, None, "ProfilerStep#x", "fsdp_sim::" + "x" * 5000
                                    + "::forward"])
            notes.append(f"event.name={e['name']!r:.40}")
    text = dump(trace, "json")
    if rng.random() < 0.08:
        text = rng.choice(["", "{", nest(100_000), "\xff", "[" + "{}," * 10 + "]"])
    compute = case.data.setdefault("compute", {}) if isinstance(case.data, dict) else {}
    if isinstance(compute, dict):
        compute["trace"] = "trace.json"
    case.files["trace.json"] = text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff"
    case.notes.append(f"trace {notes}")


def m_profile(rng, case):
    """hardware.profile: a relative path to a mutated copy of a shipped profile, or an odd name."""
    hardware = case.data.get("hardware") if isinstance(case.data, dict) else None
    if not isinstance(hardware, dict):
        return
    if rng.random() < 0.3:
        hardware["profile"] = rng.choice(["../../etc/passwd", "h100-sxm\n", "x" * 300, "", ".yaml", "/", "/tmp",
                                          "gpu", "profiles/gpu.yaml", "/dev/null.yaml", "a/../h100-sxm.yaml",
                                          "x" * 300 + ".yaml", "h100-sxm.yml"])
        case.notes.append(f"profile name {hardware['profile']!r:.40}")
        return
    source = rng.choice(PROFILES)
    profile = yaml.safe_load(source.read_text())
    key = rng.choice(["memory_bytes", "hbm_bandwidth_Bps", "peak_flops.bf16", "peak_flops.fp32", "peak_flops",
                      "matmul_efficiency", "gpus_per_node", "sm_count", "cuda_context_bytes", "nccl_bytes",
                      "fabric.nccl_channels", "fabric.ring.hop_latency_s", "fabric.ring.all_gather_busbw_Bps",
                      "fabric.network.nic_gbps", "fabric.network.size_curve.size_bytes", "arch", "name"])
    value = rng.choice([math.inf, math.nan, 1e300, 1e308, 1e-300, 5e-324, 2**63, 2**64, 10**30, 0.5, 1.5, 1e39,
                        Raw(".inf"), Raw(".nan"), "x", None, [1, 2], 1, 1e6]) if rng.random() < 0.8 else nasty(rng)
    node = profile
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    sub = rng.choice(["gpu.yaml", "profiles/gpu.yaml"])
    case.files[sub] = dump(profile)
    hardware["profile"] = sub
    hardware.pop("gpus_per_node", None) if rng.random() < 0.5 else None
    case.notes.append(f"profile {source.name} {key}={value!r:.40}")
