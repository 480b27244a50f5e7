"""tools/train/synth_tasks.py and tools/train/tiny_mix.py: deterministic generators with exact answers, a train / eval split
that cannot overlap, prompts sized by tokens, needles that point at what the answer depends on, training windows
built from (seed, step) alone, and the shipped task files."""
from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "train"))

import synth_tasks as S  # noqa: E402
import tiny_data as D  # noqa: E402

TASKS = ROOT / "compiledllm" / "assets" / "tasks"
SYNTH_FILES = {"arithmetic": 64, "lists": 64, "retrieval_1k": 64, "retrieval_2k": 64, "retrieval_4k": 64,
               "retrieval_8k": 32, "var_binding": 64}


@pytest.fixture(scope="module")
def corpus():
    files = D.read_corpus(D.stdlib_root(), 80)
    train, held = D.split(files, 0.3)
    return train, [f for f in held if not f.is_test] or held


@pytest.fixture(scope="module")
def tok(corpus):
    return D.train_tokenizer([f.text for f in corpus[0]], 512, digits=True)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def check_answer(s: S.Sample) -> None:
    """The reference, recomputed from the prompt alone."""
    assert s.reference == f" {s.answer}\n"
    if s.kind in ("add", "mul"):
        a, op, b, eq = s.prompt.split()
        assert eq == "=" and int(s.answer) == (int(a) + int(b) if op == "+" else int(a) * int(b))
        return
    name, shown, eq = s.prompt.split(" ", 1)[0].rstrip(":"), s.prompt.split(" ", 1)[1][:-2], s.prompt[-1]
    xs = ast.literal_eval(shown)
    expect = {"sort": sorted(xs), "reverse": xs[::-1], "copy": xs}[name]
    assert eq == "=" and ast.literal_eval(s.answer) == expect and name == s.kind


def test_short_generators_are_deterministic_and_exact(tok):
    for kind, gen in S.SHORT.items():
        a = [gen(random.Random(7)) for _ in range(3)]
        b = [gen(random.Random(7)) for _ in range(3)]
        assert a == b, kind
        rng = random.Random(kind)
        for _ in range(300):
            s = gen(rng)
            check_answer(s)
            # the prompt ends on a token boundary: the model can produce the reference's ids after the prompt's
            assert enc(tok, s.prompt + s.reference) == enc(tok, s.prompt) + enc(tok, s.reference)
    digits = {len(S.addition(random.Random(i)).prompt.split()[0]) for i in range(200)}
    assert digits == {2, 3, 4, 5}
    assert all(t == 1 for t in map(len, (enc(tok, d) for d in "0123456789")))  # one token per digit


def test_long_generators_answers_and_needles():
    for seed in range(40):
        r = S.retrieval(random.Random(seed), n_questions=3)
        assert r == S.retrieval(random.Random(seed), n_questions=3)
        table = ast.literal_eval(r.pieces[0].split("=", 1)[1])
        assert len(table) == r.n_entries and 8 <= r.n_entries <= 16
        for q in r.questions:
            key = q.text.split('"')[1]
            assert int(q.reference) == table[key] and q.reference.endswith("\n")
            (p, a, b), = q.needles
            assert r.pieces[p][a:b] == f'    "{key}": {table[key]},\n'
            # distractors: keys of the same letters that differ from the needle in at most two digits
        keys = list(table)
        assert len({k[:2] for k in keys}) == 1
        assert any(sum(x != y for x, y in zip(k, q.text.split('"')[1])) <= 2 for k in keys
                   if k != q.text.split('"')[1])
        b = S.binding(random.Random(seed))
        q, = b.questions
        scope: dict = {}
        exec("".join(b.pieces), {}, scope)  # the pieces are real Python: definitions, then aliases in order
        name = q.text.removeprefix("assert ").removesuffix(" ==")
        assert scope[name] == int(q.reference)
        chain_text = "".join(b.pieces[p][x:y] for p, x, y in q.needles)
        assert name in chain_text and q.reference.strip() in chain_text


def test_train_and_eval_items_are_disjoint_by_construction():
    seen = {"train": set(), "eval": set()}
    for split in ("train", "eval"):
        rng = random.Random(split)
        for gen in S.SHORT.values():
            for _ in range(400 if split == "train" else 60):
                s = gen(rng, split)
                assert S.split_of(s.canonical) == split
                seen[split].add(s.canonical)
        for _ in range(60):
            for q in S.retrieval(rng, split, n_questions=2).questions + S.binding(rng, split).questions:
                assert S.split_of(q.canonical) == split
                seen[split].add(q.canonical)
    assert not seen["train"] & seen["eval"]
    share = sum(S.split_of(f"add/{a}+{a + 1}") == "eval" for a in range(20000)) / 20000
    assert 0.04 < share < 0.06  # EVAL_PERMILLE = 50
    files = S.short_task_file("arithmetic", 10) + S.short_task_file("lists", 9)
    assert all(S.split_of(t["meta"]["canonical"]) == "eval" for t in files)
    assert files == S.short_task_file("arithmetic", 10) + S.short_task_file("lists", 9)


def test_long_task_prompts_hit_their_token_size(tok, corpus):
    filler = S.FillerLines([f.text for f in corpus[1]])
    for kind, context in (("retrieval", 1024), ("binding", 512)):
        recs = S.long_task_file(kind, 3, context, tok, filler)
        assert recs == S.long_task_file(kind, 3, context, tok, filler)  # fixed seed
        for r in recs:
            m = r["meta"]
            n = len(enc(tok, r["prompt"]))
            assert n == m["prompt_tokens"] and context - 128 - 48 <= n <= context - 128, (n, context)
            for (a, b), (i, j) in zip(m["needle_chars"], m["needle_tokens"]):
                span = r["prompt"][a:b]
                assert r["reference"].strip() in span or "=" in span
                assert span.strip() in tok.decode(enc(tok, r["prompt"])[i:j])
            assert m["distance_tokens"] >= (400 if context == 1024 else 150)
            assert S.split_of(m["canonical"]) == "eval" and r["metric"] == "exact"


def test_render_ids_roles_and_length(tok, corpus):
    stream = np.asarray(D.token_stream(D.encode_files(tok, corpus[0][:10])), np.int32)
    import tiny_mix as M

    w = M.Windows(tok, stream, M.MixConfig(), D.EOS)
    s = S.retrieval(random.Random(3), n_questions=2)
    ids, roles = S.render_ids(s, w.encode, w.filler, np.random.default_rng(0), 600, D.EOS)
    assert 560 <= len(ids) <= 600 and len(ids) == len(roles)
    answers = ids[roles == S.ROLE_ANSWER].tolist()
    assert answers == sum((enc(tok, q.reference) for q in s.questions), []) + [D.EOS]
    assert D.EOS not in ids[:-1].tolist()  # filler's file separators became newlines
    text = tok.decode(ids[:-1].tolist())
    assert text.startswith(s.pieces[0]) and s.questions[0].text in text


def test_batches_depend_on_seed_and_step_only(tok, corpus):
    import tiny_mix as M

    stream = np.asarray(D.token_stream(D.encode_files(tok, corpus[0][:20])), np.int32)
    mix = M.MixConfig(lookup_len=(64, 256), long_len=(128, 512))
    shapes = M.Shapes(256, 3, 512, 2, long_from=1, long_every=2)
    bd = M.Objective("bd", noisy_cap=128)

    def batches(obj):
        return M.Batches(M.Windows(tok, stream, mix, D.EOS), shapes, obj, 5, tok.get_vocab_size(), 3, D.MASK, D.PAD)

    a, b = batches(bd).make(1), batches(bd).make(1)
    assert a["long"] and all(np.array_equal(a[k], b[k]) for k in a if isinstance(a[k], np.ndarray))
    assert not np.array_equal(batches(bd).make(2)["tokens"], a["tokens"])
    # long step: x0 (512) then 128 noisy slots; the answers' blocks are noisy; dummies see only themselves
    assert a["tokens"].shape == (2, 640) and a["n_clean"] == 512
    noisy_pos, x0 = a["positions"][:, 512:], a["tokens"][:, :512]
    real = a["bids"][:, 512:] >= 0
    assert (np.take_along_axis(x0, noisy_pos, 1)[real] == a["targets"][real]).all()
    assert (a["weights"][~real] == 0).all() and a["answer"].any()
    # a prompt token is never masked; masked slots hold MASK
    assert (a["tokens"][:, 512:][a["masked"]] == D.MASK).all()
    m = batches(M.Objective("mdm")).make(0)
    assert m["tokens"].shape == (3, 256) and m["n_clean"] == 0 and "bids" not in m
    assert (m["tokens"][m["masked"]] == D.MASK).all() and (m["weights"][~m["masked"]] == 0).all()


def test_digit_split_encoder_is_exact(tok, corpus):
    """The training windows' fast encoder gives the tokenizer's ids on every kind of generated text."""
    import tiny_mix as M

    fast = M.DigitSplitEncoder(tok, cache_size=64)
    rng = random.Random(11)
    texts = [t for kind in S.SHORT.values() for s in (kind(rng) for _ in range(60)) for t in (s.prompt, s.reference)]
    for s in [S.retrieval(rng, n_questions=3) for _ in range(15)] + [S.binding(rng) for _ in range(15)]:
        texts += list(s.pieces) + [t for q in s.questions for t in (q.text, q.reference)]
    texts += ["x = 10.5e3\n", "  0x1F  ", "é1", "", "9"]
    assert all(fast.encode(t) == enc(tok, t) for t in texts)
    w = M.Windows(tok, np.asarray(enc(tok, corpus[0][0].text), np.int32), M.MixConfig(), D.EOS)
    assert w.fast is not None and w.encode(texts[:4]) == [enc(tok, t) for t in texts[:4]]
    plain = D.train_tokenizer([f.text for f in corpus[0][:20]], 400)  # digits merged: the tokenizer is used
    assert M.Windows(plain, np.asarray(enc(plain, "a = 1\n" * 50), np.int32), M.MixConfig(), D.EOS).fast is None


def test_curriculum_schedule():
    import tiny_mix as M

    mix = M.MixConfig(shares=(0.2, 0.4, 0.4), early_shares=(0.0, 0.8, 0.2), lookup_len=(100, 1000),
                      lookup_start=300, grow_steps=100)
    assert mix.schedule(0) == ((0.0, 0.8, 0.2), (100, 300))
    shares, (_, hi) = mix.schedule(50)
    assert np.allclose(shares, (0.1, 0.6, 0.3)) and hi == 650
    assert mix.schedule(100) == mix.schedule(10**6) == ((0.2, 0.4, 0.4), (100, 1000))
    assert M.MixConfig().schedule(0) == (M.MixConfig().shares, M.MixConfig().lookup_len)  # no curriculum


def test_eos_padding_and_loss_weights(tok, corpus):
    """Answers are followed by trained EOS padding (weight pad_weight), for block diffusion too, and a long step's
    noisy blocks without answers weigh other_weight."""
    import tiny_mix as M

    stream = np.asarray(D.token_stream(D.encode_files(tok, corpus[0][:20])), np.int32)
    mix = M.MixConfig(shares=(0.0, 1.0, 0.0), lookup_len=(64, 256), long_len=(128, 512), eos_pad=(3, 3))
    obj = M.Objective("bd", noisy_cap=128, keep_weight=0.0, p_t2t=0.0, pad_weight=0.5, other_weight=0.25)
    b = M.Batches(M.Windows(tok, stream, mix, D.EOS), M.Shapes(256, 2, 512, 2, long_from=1, long_every=2), obj, 3,
                  tok.get_vocab_size(), 3, D.MASK, D.PAD)
    short, long = b.make(0), b.make(1)
    w, tgt, ans = short["weights"], short["targets"], short["answer"]
    pads = (w == 0.5) & (tgt == D.EOS) & ~ans
    assert pads.sum() >= 3 and set(np.unique(w[short["masked"]]).tolist()) <= {0.5, 1.0}
    ids = short["tokens"][0, :256].tolist()
    i = ids.index(D.EOS)  # an answer's EOS, then the three padding EOS
    assert ids[i : i + 4] == [D.EOS] * 4 and ids[i + 4] != D.EOS
    lw = long["weights"][long["masked"]]
    assert (lw == 0.25).any() and (lw == 1.0).any()  # code blocks vs answer blocks


def test_bd_mask_matches_a_literal_rule():
    import torch

    sys.path.insert(0, str(ROOT / "tools" / "train"))
    import tiny_fast

    n_clean = 6
    bids = torch.tensor([[0, 0, 1, 1, 2, 2, 1, 1, -1, -2]])  # 6 clean, noisy block 1 (2 tokens), 2 dummies
    mask = tiny_fast.bd_dense_mask(bids, n_clean)[0, 0]
    for q in range(10):
        for k in range(10):
            qb, kb = bids[0, q].item(), bids[0, k].item()
            if q < n_clean:
                want = k < n_clean and kb <= qb
            else:
                want = (k < n_clean and kb < qb) or (k >= n_clean and kb == qb)
            assert mask[q, k].item() == want, (q, k)
    assert mask[8].tolist() == [False] * 8 + [True, False]  # a dummy sees only itself


@pytest.mark.parametrize("name", sorted(SYNTH_FILES))
def test_shipped_task_files(name, tok):
    from compiledllm.evaluate import load_tasks
    from compiledllm.tokenizer import TextTokenizer

    path = TASKS / f"{name}.jsonl"
    recs = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert len(recs) == SYNTH_FILES[name] and len({r["prompt"] for r in recs}) == len(recs)
    for r in recs:
        assert r["metric"] == "exact" and r["reference"] == f" {r['meta']['answer']}\n"
        assert S.split_of(r["meta"]["canonical"]) == "eval"
        if name in ("arithmetic", "lists"):
            check_answer(S.Sample(r["meta"]["kind"], r["prompt"], r["reference"], r["meta"]["canonical"]))
        else:
            m = r["meta"]
            assert m["prompt_tokens"] <= m["context"] - 128 and m["needle_chars"] and m["needle_tokens"]
            for a, b in m["needle_chars"]:
                assert r["prompt"][a:b].endswith("\n")
    tasks = load_tasks(path, TextTokenizer(tok, {}), limit=2)
    assert len(tasks) == 2 and tasks[0].reference_ids == enc(tok, recs[0]["reference"])


def test_continuation_tasks_cut_held_out_text_at_a_token_boundary(tmp_path):
    """tools/train/continuation_tasks.py: prompt + reference are the source task's text under the checkpoint's
    tokenizer, the reference its last `tokens` tokens, the prompt at most max_prompt tokens before them; too-short
    texts are left out; the shipped file is what the
    tool writes from code_long.jsonl for tiny-llada2.1, and the tool never overwrites."""
    import continuation_tasks as C
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "compiledllm/assets/tiny-llada2.1/tokenizer.json"))
    source = [json.loads(ln) for ln in (TASKS / "code_long.jsonl").read_text().splitlines()]
    tasks = C.continuation_tasks(source[:6], tok, 64, 4, 1024, 512)
    assert len(tasks) == 4
    for t in tasks:
        src = next(s for s in source if s["id"] == t["meta"]["from"])
        assert t["prompt_ids"] + t["reference_ids"] == enc(tok, src["prompt"] + src["reference"])[-576:]
        assert len(t["reference_ids"]) == 64 and len(t["prompt_ids"]) == 512
    assert C.continuation_tasks(source[:6], tok, 64, 4, 10 ** 6, 512) == []
    shipped = [json.loads(ln) for ln in (TASKS / "code_continue_256.jsonl").read_text().splitlines()]
    assert shipped == C.continuation_tasks(source, tok, 256, 32, 768, 768)
    out = tmp_path / "t.jsonl"
    out.write_text("keep")
    with pytest.raises(SystemExit, match="exists"):
        C.main(["--checkpoint", str(ROOT / "compiledllm/assets/tiny-llada2.1"), "--source",
                str(TASKS / "code_long.jsonl"), "--out", str(out)])
    assert out.read_text() == "keep"
