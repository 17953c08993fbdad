"""g01's FP8 path (issue 37) on the CPU: the pieces `./check.sh gpu` only reaches on a GPU.

- fp8_checkpoint_modules / use_fp8 / load_fp8_checkpoint on tiny block-FP8 checkpoints of four families (128 x 128
  blocks, k05's): the converted modules hold the checkpoint's float8 bytes and scales exactly (no dequantize round
  trip), packed qkv / gate_up and per-expert shards included; the rest of the model equals m06's load.
- GPUModelRunner's eager step on that FP8 model in Triton's interpreter (k05's kernels, fp32 activations) inside e05's
  engine: greedy tokens equal e05's engine on the same checkpoint dequantized by m06.
- Dummy FP8 weights (bench --dtype fp8): use_fp8(quantize=True) stores k05's quantize_block_fp8 of each shard, and
  build_on_device (parameters on the meta device first, FP8 ones never in the model dtype) stores the same bytes.
- fp8_mode: "auto" picks FP8 for an FP8 folder on CUDA only; explicit FP8 off CUDA is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import random, tempfile
from pathlib import Path
import torch
_zeros = torch.zeros
torch.zeros = lambda *a, **k: _zeros(*a, **{n: v for n, v in k.items() if n != "pin_memory"})   # no pinned memory here
from course.grader import select
from checks import hf_models
from checks.kit import Rand
e01, e05, g01, m06, k05 = (select.load(m) for m in ("e01_sampling", "e05_engine", "g01_gpu_engine", "m06_models",
                                                     "k05_fp8"))
FP8 = torch.float8_e4m3fn
cpu = torch.device("cpu")
for family in ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text"):
    r = Rand(11)
    config = hf_models.tiny_config(family, r, vocab=64, layers=2 if family.startswith("qwen3_5") else None)
    hf = hf_models.hf_model(family, config, r)
    folder = Path(tempfile.mkdtemp(prefix="course-fp8-"))
    hf_models.fp8_checkpoint(hf, folder, (128, 128))
    tensors, _ = hf_models.fp8_tensors(hf_models.per_expert_state_dict(hf.state_dict()), (128, 128))
    model, _ = g01.build_on_device(str(folder), torch.float32, cpu, quantization="fp8")
    ref = m06.from_pretrained(folder)
    fp8 = {n: p for n, p in model.named_parameters() if p.dtype == FP8}
    linears = [n for n, mod in model.named_modules() if isinstance(mod, g01.FP8Linear)]
    assert linears and all(k + "_scale_inv" in dict(model.named_parameters()) for k in fp8), (family, sorted(fp8))
    assert not any(isinstance(mod, torch.nn.Linear) and n.endswith(("qkv_proj", "o_proj", "down_proj"))
                   for n, mod in model.named_modules()), family
    # bytes and scales as the checkpoint has them, shard by shard
    for n in linears:
        mod = model.get_submodule(n)
        parent, leaf = n.rsplit(".", 1)
        names = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(leaf, [leaf])
        for i, sub in enumerate(names):
            w, s = mod.shard(i) if len(names) > 1 else (mod.weight, mod.weight_scale_inv)
            key = f"{parent}.{sub}.weight"
            assert torch.equal(w.view(torch.uint8), tensors[key].view(torch.uint8)), key
            assert torch.equal(s, tensors[key + "_scale_inv"]), key
    for n, mod in model.named_modules():
        if n.endswith(".experts"):
            e_count, inter = mod.down_proj.shape[0], mod.down_proj.shape[-1]
            grid = mod.gate_up_proj_scale_inv.shape[1] // 2
            for e in range(e_count):
                for part, w, s in (("gate", mod.gate_up_proj[e, :inter], mod.gate_up_proj_scale_inv[e, :grid]),
                                   ("up", mod.gate_up_proj[e, inter:], mod.gate_up_proj_scale_inv[e, grid:]),
                                   ("down", mod.down_proj[e], mod.down_proj_scale_inv[e])):
                    key = f"{n}.{e}.{part}_proj.weight"
                    assert torch.equal(w.view(torch.uint8), tensors[key].view(torch.uint8)), key
                    assert torch.equal(s, tensors[key + "_scale_inv"]), key
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if p.dtype != FP8 and not n.endswith("_scale_inv"):
            assert torch.equal(p, ref_params[n]), n
    # the engine: GPUModelRunner's eager step with k05 in the interpreter vs e05 on the dequantized checkpoint
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=24, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 64) for _ in range(rng.randint(2, 10))] for _ in range(4)]
    params = e01.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = [o.token_ids for o in e05.LLM(str(folder), **kw).generate(prompts, params)]
    llm = e05.LLM(str(folder), **kw)
    gpu = g01.GPUModelRunner(model, 4, 4, llm.config.max_model_len, 24, num_blocks=256, enforce_eager=True)
    if hasattr(llm.runner, "state_cache"):
        llm.runner.runner = gpu
    else:
        llm.runner = gpu
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want, (family, got, want)
    print(family, "ok")
# dummy FP8 weights: each shard quantized by k05 (bench --dtype fp8)
config = hf_models.tiny_config("qwen3_5_moe_text", Rand(2), vocab=64, layers=2)
with torch.device("cpu"):
    dense = m06.build_model(config)
g01.dummy_weights_(dense, seed=3)
before = {n: p.detach().clone() for n, p in dense.named_parameters()}
done = g01.use_fp8(dense, quantize=True)
for n in done:
    mod = dense.get_submodule(n)
    if isinstance(mod, g01.FP8Linear):
        for i, part in enumerate(before[n + ".weight"].split(mod.shard_rows)):
            q, s = k05.quantize_block_fp8(part)
            w, ws = mod.shard(i)
            assert torch.equal(w.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ws, s), n
    else:
        inter = mod.down_proj.shape[-1]
        grid = mod.gate_up_proj_scale_inv.shape[1] // 2
        q, s = k05.quantize_block_fp8(before[n + ".gate_up_proj"][:, inter:])
        assert torch.equal(mod.gate_up_proj[:, inter:].view(torch.uint8), q.view(torch.uint8)), n
        assert torch.equal(mod.gate_up_proj_scale_inv[:, grid:], s), n
assert any(n.endswith(".experts") for n in done) and any(n.endswith("in_proj_qkv") for n in done), sorted(done)
# built directly in FP8 (meta device, then one model-dtype tensor at a time): the same bytes as the path above
direct, _ = g01.build_on_device(config, torch.float32, cpu, seed=3, quantization="fp8")
mine = dict(direct.named_parameters())
assert sorted(mine) == sorted(n for n, _ in dense.named_parameters()), sorted(set(mine) ^ set(dict(dense.named_parameters())))
for n, p in dense.named_parameters():
    assert p.dtype == mine[n].dtype and torch.equal(p.view(torch.uint8) if p.dtype == FP8 else p,
                                                    mine[n].view(torch.uint8) if p.dtype == FP8 else mine[n]), n
assert not any(p.is_meta for p in direct.parameters())
# fp8_mode
assert g01.fp8_mode(str(folder), "auto", torch.device("cpu"), 1) is None
assert g01.fp8_mode(str(folder), "auto", torch.device("cuda"), 1) == "fp8"
assert g01.fp8_mode(str(folder), "auto", torch.device("cuda"), 2) is None
for bad in (("fp8", torch.device("cpu"), 1), ("w8a8", torch.device("cuda"), 2)):
    try:
        g01.fp8_mode(str(folder), *bad)
    except ValueError:
        pass
    else:
        raise AssertionError(bad)
print("OK")
"""


def test_fp8_engine_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", COURSE_SELECTION='{"default": "solutions"}')
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
