"""``lightning-llm prepare`` and packed documents: round trips, parallel determinism, dtypes, document ids and masks."""

import json
import random
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import LLMDataModule, document_causal_mask, read_offsets, read_token_info, token_dtype_for
from lightning_llm.data.prepare import prepare, train_bpe
from lightning_llm.models import CausalLM, Llama, LlamaConfig
from lightning_llm.testing import cpu_trainer

pytestmark = pytest.mark.timeout(120)

EDGE_DOCS = ["  leading spaces and trailing ones  ", "tabs\tand a\nsingle newline", "emoji 🙂 and ünïcödé, 中文", "x"]


def _corpus(count: int, seed: int = 0) -> list[str]:
    """Documents of a small grammar (learnable in a few steps), plus the edge cases above."""
    rng = random.Random(seed)
    subjects, verbs = ["the cat", "a dog", "my friend", "the old man", "Zoë"], ["sees", "likes", "finds", "paints"]
    objects = ["a red ball", "the moon", "two birds", "café au lait"]
    docs = [
        " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(rng.randint(1, 6)))
        for _ in range(count)
    ]
    # An indented document lands in the .txt half: only blank lines separate, the indentation stays.
    return ["    indented first line\n  and a second", *docs, *EDGE_DOCS]


def _write_inputs(root: Path, docs: list[str]) -> list[str]:
    """Half of ``docs`` in a .txt (blank-line separated), half in a .jsonl; returns the two paths."""
    half = len(docs) // 2
    (root / "a.txt").write_text("\n\n".join(docs[:half]) + "\n\n\n", encoding="utf-8")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[half:])))
    return [str(root / "a.txt"), str(root / "b.jsonl")]


def _documents(token_file: Path) -> list[np.ndarray]:
    tokens = np.fromfile(token_file, dtype=read_token_info(token_file).dtype)
    offsets = read_offsets(token_file)
    return [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def test_txt_and_jsonl_round_trip_through_the_trained_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    docs = _corpus(12)
    infos = prepare(_write_inputs(tmp_path, docs), tmp_path / "out", vocab_size=300, txt_split="blank_line")
    info = read_token_info(tmp_path / "out" / "train.bin")
    assert info == infos["train"]
    tok = Tokenizer.from_file(str(tmp_path / "out" / info.tokenizer))  # the sidecar's path, relative to it
    assert (info.dtype, info.vocab_size, info.eos_id, info.num_documents) == ("uint16", 300, 0, len(docs))
    written = _documents(tmp_path / "out" / "train.bin")
    assert sum(map(len, written)) == info.num_tokens
    assert [tok.decode(d[:-1].tolist()) for d in written] == docs  # the tokenizer as the oracle, in input order
    assert all(d[-1] == info.eos_id and info.eos_id not in d[:-1] for d in written), "one EOS, after each document"


def test_a_txt_file_is_one_document_by_default(tmp_path):
    text = "First paragraph.\n\nSecond paragraph, same document.\n"
    (tmp_path / "doc.txt").write_text(text)
    prepare([str(tmp_path / "doc.txt")], tmp_path / "out", vocab_size=260)
    from tokenizers import Tokenizer

    (written,) = _documents(tmp_path / "out" / "train.bin")
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.decode(written[:-1].tolist()) == text


def test_a_given_tokenizer_is_used_as_is_and_its_eos_found(tmp_path):
    docs = _corpus(8, seed=1)
    tok = train_bpe(docs, 280)
    tok.add_special_tokens(["</s>"])  # a Llama-2-style separator, named below
    tok.save(str(tmp_path / "given.json"))
    default = prepare(_write_inputs(tmp_path, docs), tmp_path / "default", tokenizer=tmp_path / "given.json")
    assert default["train"].eos_id == tok.token_to_id("<|endoftext|>"), "the first of EOS_CANDIDATES it holds"
    infos = prepare(
        _write_inputs(tmp_path, docs),
        tmp_path / "out",
        tokenizer=tmp_path / "given.json",
        eos_token="</s>",
        txt_split="blank_line",
        val_fraction=0.25,
    )
    eos = tok.token_to_id("</s>")
    assert infos["train"].eos_id == infos["val"].eos_id == eos
    assert infos["train"].tokenizer == str((tmp_path / "given.json").resolve())
    assert not (tmp_path / "out" / "tokenizer.json").exists(), "a given tokenizer is not trained or copied"
    # Every 4th document (evenly spread) is held out: 3 of 12.
    val_docs = [d for i, d in enumerate(docs) if (i + 1) % 4 == 0]
    train_docs = [d for i, d in enumerate(docs) if (i + 1) % 4]
    for name, expected in (("train", train_docs), ("val", val_docs)):
        written = _documents(tmp_path / "out" / f"{name}.bin")
        assert [d[:-1].tolist() for d in written] == [tok.encode(d, add_special_tokens=False).ids for d in expected]
    with pytest.raises(ValueError, match="eos_token='<end>'.*--eos_token"):
        prepare(_write_inputs(tmp_path, docs), tmp_path / "out2", tokenizer=tmp_path / "given.json", eos_token="<end>")


def test_two_workers_write_the_same_bytes_as_one(tmp_path, monkeypatch):
    from lightning_llm.data import prepare as prep

    monkeypatch.setattr(prep, "CHUNK_DOCUMENTS", 7)  # many chunks, so the workers interleave
    inputs = _write_inputs(tmp_path, _corpus(60, seed=2))
    prepare(inputs, tmp_path / "one", vocab_size=300, val_fraction=0.1, workers=1, txt_split="blank_line")
    prepare(
        inputs,
        tmp_path / "two",
        tokenizer=tmp_path / "one" / "tokenizer.json",
        val_fraction=0.1,
        workers=2,
        txt_split="blank_line",
    )
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_dtype_is_uint16_up_to_65536_ids_and_uint32_beyond(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert [token_dtype_for(n) for n in (256, 65535, 65536, 65537, 128256)] == ["uint16"] * 3 + ["uint32"] * 2
    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "d.jsonl").write_text('{"text": "w1 w65535 w65536 w69999"}\n{"text": "w3"}\n')
    info = prepare([str(tmp_path / "d.jsonl")], tmp_path / "out", tokenizer=tmp_path / "big.json")["train"]
    assert (info.dtype, info.vocab_size, info.eos_id) == ("uint32", 70_002, 70_000)
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * 7
    expected = [1, 65535, 65536, 69999, 70_000, 3, 70_000]
    assert np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32).tolist() == expected
    # The data module reads the dtype from the sidecar: no token_dtype in its arguments.
    dm = LLMDataModule(source="tokens", path=str(tmp_path / "out" / "train.bin"), seq_len=2, val_fraction=0.5)
    dm.setup()
    assert dm.vocab_size == 70_002 and dm.max_token_id == 70_000
    assert dm.train_set[0].tolist() == expected[:3]
    with pytest.raises(ValueError, match="token_dtype='uint16'.*drop token_dtype"):
        LLMDataModule(source="tokens", path=str(tmp_path / "out" / "train.bin"), token_dtype="uint16").setup()


def _eos_scan(window: torch.Tensor, eos: int) -> list[int]:
    """Brute force: the document id of position t is the number of EOS tokens before t in the window."""
    return [sum(int(x) == eos for x in window[:t]) for t in range(len(window))]


@pytest.mark.parametrize("val", ["val_fraction", "val_path"])
def test_document_ids_match_a_brute_force_scan_for_eos(tmp_path, val):
    prepare(
        _write_inputs(tmp_path, _corpus(30, seed=3)),
        tmp_path / "out",
        vocab_size=300,
        txt_split="blank_line",
        val_fraction=0.2,
    )
    out = tmp_path / "out"
    split = {"val_fraction": 0.3} if val == "val_fraction" else {"val_path": str(out / "val.bin")}
    dm = LLMDataModule(
        source="tokens", path=str(out / "train.bin"), seq_len=48, batch_size=2, return_document_ids=True, **split
    )
    dm.setup("fit")
    eos = dm.token_info.eos_id
    for dataset in (dm.train_set, dm.val_set):
        for index in range(len(dataset)):
            sample = dataset[index]
            assert sample["document_ids"].tolist() == _eos_scan(sample["input_ids"], eos), index
    assert any(dm.train_set[i]["document_ids"][-1] >= 2 for i in range(len(dm.train_set))), "packs several documents"
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "document_ids"}
    assert batch["input_ids"].shape == batch["document_ids"].shape == (2, 49)


def test_mask_helper_equals_a_brute_force_block_diagonal_causal_mask():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2, (3, 23), generator=generator).cumsum(1)  # non-decreasing, as in a packed sample
    mask = document_causal_mask(ids)
    brute = torch.tensor(
        [[[k <= q and ids[b, k] == ids[b, q] for k in range(23)] for q in range(23)] for b in range(3)]
    )
    assert mask.shape == (3, 1, 23, 23) and mask.dtype == torch.bool
    assert torch.equal(mask[:, 0], brute)
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        document_causal_mask(ids[0])


def test_with_the_mask_a_packed_document_gets_the_logits_it_gets_alone():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("tiny")).eval()
    first, second = torch.randint(1, 256, (1, 9)), torch.randint(1, 256, (1, 7))
    packed = torch.cat([first, second], dim=1)
    documents = torch.tensor([[0] * 9 + [1] * 7])
    with torch.no_grad():
        masked, plain, alone = model(packed, documents), model(packed), model(second)
    # Rotary embeddings are relative: masked to its own tokens, the second document reads as if alone.
    torch.testing.assert_close(masked[:, 9:], alone, atol=1e-5, rtol=1e-5)
    assert (plain[:, 9:] - alone).abs().max() > 1e-2, "without the mask the first document leaks in"
    torch.testing.assert_close(masked[:, :9], plain[:, :9], atol=1e-5, rtol=1e-5)


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def test_a_short_fit_on_prepared_data_lowers_the_loss(tmp_path):
    prepare(
        _write_inputs(tmp_path, _corpus(200, seed=4)),
        tmp_path / "out",
        vocab_size=320,
        val_fraction=0.1,
        txt_split="blank_line",
    )
    data = LLMDataModule(
        source="tokens",
        path=str(tmp_path / "out" / "train.bin"),
        val_path=str(tmp_path / "out" / "val.bin"),
        seq_len=64,
        batch_size=4,
        return_document_ids=True,
    )
    data.setup()
    L.seed_everything(0)
    model = CausalLM(
        LlamaConfig.from_name("tiny", vocab_size=data.vocab_size), learning_rate=3e-3, warmup_steps=5, max_steps=40
    )
    losses = _Losses()
    trainer = cpu_trainer(
        max_steps=40,
        callbacks=[losses],
        limit_val_batches=2,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    first, last = np.mean(losses.losses[:3]), np.mean(losses.losses[-5:])
    assert first > 5.0, first  # about ln(320) = 5.77 at initialisation
    assert last < first - 2.5, (first, last)
    assert trainer.callback_metrics["val_loss"] < first - 2.5


BAD_INPUTS = {
    "missing file": (lambda d: dict(inputs=[str(d / "nowhere.txt")]), FileNotFoundError, "nowhere.txt"),
    "bad text_key": (lambda d: dict(inputs=[_jsonl(d)], text_key="body"), ValueError, "text_key='body'"),
    "empty input": (lambda d: dict(inputs=[_text(d, "empty.txt", "  \n\n ")]), ValueError, "empty.txt"),
    "bad suffix": (lambda d: dict(inputs=[_text(d, "data.csv", "a,b")]), ValueError, "'.csv'"),
    "missing tokenizer": (
        lambda d: dict(inputs=[_jsonl(d)], tokenizer=str(d / "tok.json")),
        FileNotFoundError,
        "tok.json",
    ),
    "vocab too small": (lambda d: dict(inputs=[_jsonl(d)], vocab_size=100), ValueError, "vocab_size=100"),
    "val split empty": (lambda d: dict(inputs=[_jsonl(d)], val_fraction=0.01), ValueError, "val_fraction=0.01"),
    "workers": (lambda d: dict(inputs=[_jsonl(d)], workers=0), ValueError, "workers=0"),
}


def _text(root: Path, name: str, text: str) -> str:
    (root / name).write_text(text)
    return str(root / name)


def _jsonl(root: Path) -> str:
    return _text(root, "d.jsonl", '{"text": "one"}\n{"text": "two"}\n')


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_named(case, tmp_path):
    kwargs, error, named = BAD_INPUTS[case]
    kwargs = kwargs(tmp_path)
    with pytest.raises(error) as info:
        prepare(kwargs.pop("inputs"), tmp_path / "out", **{"vocab_size": 260, **kwargs})
    assert named in str(info.value), str(info.value)
    assert not (tmp_path / "out" / "train.bin").exists(), "nothing half-written is left behind"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_an_error_while_writing_leaves_the_previous_run_as_it_was(tmp_path):
    prepare([_jsonl(tmp_path)], tmp_path / "out", vocab_size=260, val_fraction=0.5)  # an earlier, good run
    before = _files(tmp_path / "out")
    bad = _text(tmp_path, "bad.jsonl", '{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match="Line 3 of .*bad.jsonl.* is not valid JSON"):
        prepare([bad], tmp_path / "out", tokenizer=tmp_path / "out" / "tokenizer.json")
    assert _files(tmp_path / "out") == before  # byte for byte, and no staging folder left


def test_an_interrupted_run_leaves_the_previous_set_and_a_finished_one_replaces_all_of_it(tmp_path, monkeypatch):
    import lightning_llm.data.prepare as prepare_module

    prepare([_jsonl(tmp_path)], tmp_path / "out", vocab_size=260, val_fraction=0.5)
    before = _files(tmp_path / "out")
    encode = prepare_module._encode

    def interrupted(*args):
        yield next(encode(*args))  # one run of documents written, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "_encode", interrupted)
    other = _text(tmp_path, "other.jsonl", "".join(f'{{"text": "another text {i}"}}\n' for i in range(30)))
    with pytest.raises(KeyboardInterrupt):
        prepare([other], tmp_path / "out", vocab_size=270)
    assert _files(tmp_path / "out") == before
    monkeypatch.setattr(prepare_module, "_encode", encode)
    prepare([other], tmp_path / "out", vocab_size=270)
    after = _files(tmp_path / "out")
    assert sorted(after) == ["tokenizer.json", "train.bin", "train.idx", "train.json"]  # val.* of the old set gone
    assert all(after[name] != before[name] for name in after)  # every file of the set is the new run's


def test_token_files_without_offsets_or_with_a_stale_sidecar_are_named(tmp_path):
    prepare([_jsonl(tmp_path)], tmp_path / "out", vocab_size=260)
    train = tmp_path / "out" / "train.bin"
    train.with_suffix(".idx").unlink()
    with pytest.raises(FileNotFoundError, match="train.idx"):
        LLMDataModule(source="tokens", path=str(train), seq_len=2, return_document_ids=True).setup()
    train.write_bytes(train.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"train.bin holds \d+ tokens but its sidecar says \d+; .* Prepare it again"):
        LLMDataModule(source="tokens", path=str(train), seq_len=2).setup()


def test_command_line_prints_one_line_per_file_and_names_bad_values(tmp_path, capsys):
    inputs = _write_inputs(tmp_path, _corpus(6))
    main(
        [
            "prepare",
            *inputs,
            "--output_dir",
            str(tmp_path / "out"),
            "--vocab_size",
            "300",
            "--val_fraction",
            "0.2",
            "--txt_split",
            "blank_line",
        ]
    )
    out = capsys.readouterr()
    assert out.out.count("documents,") == 2 and "train.bin: 9 documents" in out.out and out.err == ""
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", inputs[1], "--output_dir", str(tmp_path / "x"), "--text_key", "body"])
    assert exit_info.value.code == 2 and "text_key='body'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "prepare   tokenize .txt/.jsonl files" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    assert "usage: lightning-llm prepare [-h] --output_dir OUTPUT_DIR" in capsys.readouterr().out


class _Batches(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((batch["input_ids"].clone(), batch["document_ids"].clone(), outputs["loss"].item()))


def test_document_id_batches_resume_mid_epoch_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    prepare(_write_inputs(tmp_path, _corpus(60, seed=5)), tmp_path / "out", vocab_size=300, txt_split="blank_line")

    def fit(steps, root, resume=None, checkpoint_every=None):
        L.seed_everything(0)
        record = _Batches()
        callbacks = [record] + (
            [ModelCheckpoint(dirpath=root, filename="mid", every_n_train_steps=checkpoint_every, save_top_k=-1)]
            if checkpoint_every
            else []
        )
        data = LLMDataModule(
            source="tokens",
            path=str(tmp_path / "out" / "train.bin"),
            seq_len=32,
            batch_size=2,
            return_document_ids=True,
            seed=3,
        )
        model = CausalLM(LlamaConfig.from_name("tiny", vocab_size=300), warmup_steps=2, max_steps=8)
        L.Trainer(
            accelerator="cpu",
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=callbacks,
            default_root_dir=root,
        ).fit(model, data, ckpt_path=resume)
        return record.batches

    straight = fit(8, tmp_path / "straight")
    pieces = fit(3, tmp_path / "pieces", checkpoint_every=3) + fit(
        8, tmp_path / "pieces", resume=tmp_path / "pieces" / "mid.ckpt"
    )
    assert len(pieces) == len(straight) == 8
    for step, (got, want) in enumerate(zip(pieces, straight)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"step {step} read another batch"
        assert got[2] == want[2], f"step {step}: loss {got[2]} != {want[2]}"


def test_a_rerun_without_a_validation_split_removes_the_earlier_one(tmp_path):
    docs = [_text(tmp_path, "corpus.jsonl", "".join(f'{{"text": "document number {i}"}}\n' for i in range(40)))]
    prepare(docs, tmp_path / "out", vocab_size=270, val_fraction=0.25)
    assert (tmp_path / "out" / "val.bin").exists()
    prepare(docs, tmp_path / "out", vocab_size=270, val_fraction=0.0)  # every document now in train.bin
    assert not any((tmp_path / "out" / f"val.{suffix}").exists() for suffix in ("bin", "idx", "json"))
