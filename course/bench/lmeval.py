"""lm-evaluation-harness against `./check.sh serve --model DIR`, compared with transformers on the same folder.

    python -m course.bench.lmeval [--json results/<date>/lm-eval-tiny-qwen3.json] [--keep DIR]

Builds a tiny random fp32 Qwen3 folder offline (a byte-level BPE tokenizer trained on the spot from a few lines, a
chat template), serves it with `./check.sh serve --model DIR` on 127.0.0.1, and runs lm-eval's CLI on the local tasks
in course/bench/lmeval_tasks/ (no hub download): `local-completions` at batch sizes 1 and 80 (loglikelihood through a
multiple-choice task, generate_until with five `until` strings) and `local-chat-completions`. Every logged sample is
then recomputed with transformers on the same folder: |Δ loglikelihood|, is_greedy, the greedy text.

lm-eval (a test-only dependency: pyproject.toml's `test` extra) is installed by `./check.sh selftest` on first use.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..grader.select import ROOT
from ..runtime.tiny_tokenizer import CHAT_TEMPLATE, SPECIALS    # the dummy model's specials and template

TASKS = ROOT / "course" / "bench" / "lmeval_tasks"
TASK_NAMES = ("course_tiny_mc", "course_tiny_gen")
BATCH_SIZES = (1, 80)
CHAT_LIMIT = 24                        # chat completions go one request at a time: a sample of the documents
LL_TOL = 1e-4
TIE = 1e-5                             # a top-2 logit gap this small: is_greedy may flip on rounding alone
# The tokenizer's training text: the words of the tasks' documents, so that whole words become tokens.
LINES = [
    "the cat sat on the mat and the dog sat on the log",
    "a small model reads a small book in the morning",
    "seven red apples fell from the old tree into the river",
    "she counted one two three four five and then stopped",
    "Question: what is two plus two?\nAnswer: four.",
    "the engine schedules each request, then samples one token at a time",
]


def build_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny random fp32 Qwen3 HF folder: weights, config, a BPE tokenizer trained here, a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Printable ASCII, space, newline and tab as byte-level symbols: any token sequence decodes to valid text
    # (no partial UTF-8 to compare), and no ASCII character of a prompt is dropped for lack of a token.
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ", "ĉ"]
    tok.train_from_iterator(LINES * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                           initial_alphabet=alphabet, show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                         bos_token_id=None)
    model = Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        # Tied embeddings at half scale: the model repeats the current token often but not always, so is_greedy
        # is true for some choices (a repeated last word) and false for others, and the greedy texts vary.
        model.model.embed_tokens.weight.mul_(0.5)
    model.save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`./check.sh serve --model DIR` on 127.0.0.1 (same interpreter), stopped with Ctrl-C on exit."""

    def __init__(self, folder: Path, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, COURSE_PYTHON=sys.executable, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen([str(ROOT / "check.sh"), "serve", "--model", str(folder), "--host", "127.0.0.1",
                                      "--port", str(self.port)], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 180) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"./check.sh serve did not start: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)

    def has_remote_tokenizer(self) -> bool:
        import httpx
        return httpx.get(self.url + "/tokenizer_info", timeout=10).status_code == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_lm_eval(server: Server, folder: Path, chat: bool, batch_size: int, remote: bool) -> dict:
    """lm_eval.simple_evaluate on the local tasks (from the repo root, as their data_files expect); samples by task."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    if chat:
        model, endpoint, tasks, limit = "local-chat-completions", "/v1/chat/completions", ["course_tiny_gen"], CHAT_LIMIT
    else:
        model, endpoint, tasks, limit = "local-completions", "/v1/completions", list(TASK_NAMES), None
    args = dict(model=str(folder), base_url=server.url + endpoint, num_concurrent=1, max_retries=1, timeout=120)
    if not chat and not remote:                 # no /tokenizer_info: lm-eval tokenizes with the folder's tokenizer
        args.update(tokenizer=str(folder), tokenizer_backend="huggingface")
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, batch_size=batch_size, limit=limit,
                                  log_samples=True, apply_chat_template=chat, bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))
    return dict(model=model, batch_size=batch_size, seconds=time.perf_counter() - start, samples=out["samples"],
                model_args={k: v for k, v in args.items() if k not in ("model", "base_url", "tokenizer")})


# ---------------------------------------------------------------- transformers on the same folder

class Reference:
    def __init__(self, folder: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(folder)
        torch.set_num_threads(1)     # a tiny model: one thread is fastest, and 2 fight over a busy 2-core box
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.loglikelihood = functools.cache(self.loglikelihood)    # batch 1 and batch 80 send the same requests
        self._greedy = functools.cache(self._greedy)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split of a (context, continuation) pair: trailing spaces move to the continuation, the whole
        string is tokenized once and the continuation is what follows the context's tokens."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx):]

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool, bool]:
        """(sum of the continuation's log-probs, is_greedy, a near-tie at some continuation position)."""
        torch = self.torch
        ctx, cont = self.pair(context, continuation)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(ctx) - 1:-1].double()
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(cont)
        top2 = logits.topk(2, -1).values
        return (float(logp[torch.arange(len(cont)), target].sum()), bool((logits.argmax(-1) == target).all()),
                bool(((top2[:, 0] - top2[:, 1]) < TIE).any()))

    def greedy(self, prompt_ids: list[int], stops: list[str], max_tokens: int) -> tuple[str, str]:
        return self._greedy(tuple(prompt_ids), tuple(stops), max_tokens)

    def _greedy(self, prompt_ids: tuple[int, ...], stops: tuple[str, ...], max_tokens: int) -> tuple[str, str]:
        """Greedy decoding as the server does it: stop at EOS, or where a stop string first appears in the text
        (the text ends before it), or after max_tokens tokens. (text, why it ended: "eos", "stop" or "length")."""
        torch = self.torch
        out, past, step = [], None, torch.tensor([prompt_ids])
        for _ in range(max_tokens):
            with torch.no_grad():
                res = self.model(step, past_key_values=past, use_cache=True)
            past, token = res.past_key_values, int(res.logits[0, -1].argmax())
            if token == self.tok.eos_token_id:
                return self.tok.decode(out, skip_special_tokens=True), "eos"
            out.append(token)
            step = torch.tensor([[token]])
            text = self.tok.decode(out, skip_special_tokens=True)
            found = [text.find(s) for s in stops if s and s in text]
            if found:
                return text[:min(found)], "stop"
        return self.tok.decode(out, skip_special_tokens=True), "length"


def _args(sample: dict) -> list[tuple]:
    """The (arg_0, arg_1) of each request of a logged sample."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [(a["arg_0"], a["arg_1"]) for a in args.values()]
    return [tuple(a) for a in args]


def compare(run: dict, ref: Reference) -> dict:
    """One lm-eval run against transformers: loglikelihood pairs and greedy texts."""
    ll = dict(pairs=0, max_abs_diff=0.0, greedy_agree=0, greedy_true=0, near_ties=0, mismatches=[])
    gen = dict(texts=0, equal=0, eos=0, stop=0, length=0, mismatches=[])
    chat = run["model"] == "local-chat-completions"
    for sample in run["samples"].get("course_tiny_mc", []):
        for (context, continuation), resp in zip(_args(sample), sample["resps"]):
            got_ll, got_greedy = float(resp[0][0]), str(resp[0][1]) == "True"    # strings once written to a file
            want_ll, want_greedy, tie = ref.loglikelihood(context, continuation)
            diff = abs(got_ll - want_ll)
            ll["pairs"] += 1
            ll["max_abs_diff"] = max(ll["max_abs_diff"], diff)
            ll["greedy_true"] += bool(want_greedy)
            ll["near_ties"] += tie
            ok_greedy = bool(got_greedy) == want_greedy or tie
            ll["greedy_agree"] += ok_greedy
            if diff > LL_TOL or not ok_greedy:
                ll["mismatches"].append(dict(context=context, continuation=continuation, got=[got_ll, got_greedy],
                                             want=[want_ll, want_greedy]))
    for sample in run["samples"].get("course_tiny_gen", []):
        (prompt, kwargs), = _args(sample)
        until = list(kwargs["until"])
        if chat:      # messages as JSON; the server applies the chat template; lm-eval sends the first 4 stops
            messages = json.loads(prompt[0] if isinstance(prompt, (list, tuple)) else prompt)
            text = ref.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt_ids, stops = ref.tok.encode(text), until[:4]
        else:         # token ids from the context; lm-eval adds the EOS string to the stops
            prompt_ids = ref.encode(prompt)
            stops = until + ([ref.tok.eos_token] if ref.tok.eos_token not in until else [])
        want, why = ref.greedy(prompt_ids, stops, int(kwargs["max_gen_toks"]))
        got = sample["resps"][0][0]
        gen["texts"] += 1
        gen["equal"] += got == want
        gen[why] += 1
        if got != want:
            gen["mismatches"].append(dict(prompt=prompt, got=got, want=want))
    return dict(model=run["model"], batch_size=run["batch_size"], seconds=round(run["seconds"], 1),
                loglikelihood=ll if ll["pairs"] else None, generate_until=gen)


def evaluate(keep: Path | None = None) -> dict:
    """Build, serve, run lm-eval three ways, compare; the summary (what the result file holds)."""
    from importlib import metadata
    tmp = tempfile.TemporaryDirectory(prefix="lmeval-")
    work = Path(keep) if keep else Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    # Everything offline: the tasks' data is a committed JSONL file, datasets' cache lives in the work folder.
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "datasets-cache"),
                      TOKENIZERS_PARALLELISM="false", OPENAI_API_KEY=os.environ.get("OPENAI_API_KEY", "none"))
    phases, t0 = {}, time.perf_counter()
    folder = build_folder(work / "tiny-qwen3")
    server = Server(folder, work / "serve.log")
    runs = []
    try:
        server.wait()
        phases["build_and_serve"], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()
        remote = server.has_remote_tokenizer()
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            for batch_size in BATCH_SIZES:
                runs.append(run_lm_eval(server, folder, False, batch_size, remote))
            runs.append(run_lm_eval(server, folder, True, 1, remote))
        finally:
            os.chdir(cwd)
    finally:
        server.stop()
    phases["lm_eval"], t0 = round(time.perf_counter() - t0, 1), time.perf_counter()
    ref = Reference(folder)
    rows = [compare(run, ref) for run in runs]
    phases["transformers"] = round(time.perf_counter() - t0, 1)
    tmp.cleanup()
    lls = [r["loglikelihood"] for r in rows if r["loglikelihood"]]
    gens = [r["generate_until"] for r in rows]
    return dict(
        tokenizer_backend="remote (/tokenizer_info, /tokenize)" if remote else "huggingface (tokenizer=DIR)",
        until=_until(), rows=rows, phases_s=phases,
        summary=dict(pairs=sum(x["pairs"] for x in lls), max_abs_diff=max(x["max_abs_diff"] for x in lls),
                     greedy_agree=sum(x["greedy_agree"] for x in lls), greedy_true=sum(x["greedy_true"] for x in lls),
                     texts=sum(g["texts"] for g in gens), texts_equal=sum(g["equal"] for g in gens),
                     texts_at_stop_string=sum(g["stop"] for g in gens)),
        versions={d: metadata.version(d) for d in ("lm-eval", "transformers", "tokenizers", "datasets")})


def _until() -> list[str]:
    import yaml
    return yaml.safe_load((TASKS / "course_tiny_gen.yaml").read_text(encoding="utf-8"))["generation_kwargs"]["until"]


def passed(result: dict) -> bool:
    s = result["summary"]
    return s["pairs"] > 0 and s["max_abs_diff"] <= LL_TOL and s["greedy_agree"] == s["pairs"] and \
        s["texts"] > 0 and s["texts_equal"] == s["texts"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course.bench.lmeval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the comparison, command, machine and versions here")
    parser.add_argument("--keep", type=Path, help="keep the model folder, server log and lm-eval output here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = evaluate(args.keep)
    result["seconds"] = round(time.perf_counter() - start, 1)
    for row in result["rows"]:
        ll, gen = row["loglikelihood"], row["generate_until"]
        head = f"{row['model']:<24} batch {row['batch_size']:>2}  {row['seconds']:5.1f} s"
        if ll:
            head += (f"  loglikelihood {ll['pairs']} pairs, max |Δ| {ll['max_abs_diff']:.1e}, is_greedy "
                     f"{ll['greedy_agree']}/{ll['pairs']} ({ll['greedy_true']} true)")
        print(head + f"  greedy texts {gen['equal']}/{gen['texts']} (ended by a stop string {gen['stop']}, "
                     f"EOS {gen['eos']}, max_gen_toks {gen['length']})")
        for m in (ll["mismatches"] if ll else [])[:5] + gen["mismatches"][:5]:
            print("   MISMATCH", json.dumps(m, ensure_ascii=False))
    print(f"tokenizer: {result['tokenizer_backend']}; {result['seconds']} s in all")
    if args.json:
        from .common import machine_info
        doc = dict(command="python -m course.bench.lmeval " + " ".join(argv if argv is not None else sys.argv[1:]),
                   machine=machine_info(), **result)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
