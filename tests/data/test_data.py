import math

import numpy as np
import pytest
import torch

from lightning_llm.data import (
    ByteTokenizer,
    LLMDataModule,
    ResumableDistributedSampler,
    TokenWindows,
    entropy_floor,
    markov_corpus,
    read_token_file,
)


def test_markov_corpus_is_deterministic_and_has_the_stated_entropy():
    a = markov_corpus(50_000, vocab_size=32, branching=4, seed=3)
    assert np.array_equal(a, markov_corpus(50_000, vocab_size=32, branching=4, seed=3))
    assert not np.array_equal(a, markov_corpus(50_000, vocab_size=32, branching=4, seed=4))
    # Empirical conditional entropy H(next | prev) from bigram counts matches log(branching).
    counts = np.zeros((32, 32))
    np.add.at(counts, (a[:-1], a[1:]), 1)
    visited = counts.sum(1) > 0  # a state no other state leads to is never visited
    assert ((counts[visited] > 0).sum(1) == 4).all()
    probs = counts / counts.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        cond = -np.nansum(probs * np.log(probs), axis=1)
    weights = counts.sum(1) / counts.sum()
    assert float(weights @ cond) == pytest.approx(entropy_floor(4), abs=0.01)
    assert entropy_floor(4) == pytest.approx(math.log(4))


def test_token_windows_shift_by_one_and_cover_every_target_once():
    ds = TokenWindows(np.arange(101), seq_len=10)
    assert len(ds) == 10
    assert torch.equal(ds[0], torch.arange(11))
    assert torch.equal(ds[1][:1], torch.tensor([10]))
    targets = torch.cat([ds[i][1:] for i in range(len(ds))])
    assert torch.equal(targets, torch.arange(1, 101))


def test_token_file_memmap_roundtrip(tmp_path):
    tokens = np.arange(70_000, dtype=np.uint32) * 3
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    read = read_token_file(path, "uint32")
    assert isinstance(read, np.memmap) and np.array_equal(read, tokens)
    with pytest.raises(ValueError, match="not a whole number of uint32 tokens"):
        (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
        read_token_file(tmp_path / "odd.bin", "uint32")


def test_missing_files_name_the_path(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        LLMDataModule(source="tokens", path=str(missing)).setup("fit")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        LLMDataModule(source="text", path=str(tmp_path / "nope.txt")).setup("fit")
    with pytest.raises(ValueError, match="needs `path`"):
        LLMDataModule(source="tokens")


def test_text_source_is_byte_tokenized(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 200
    (tmp_path / "a.txt").write_text(text)
    dm = LLMDataModule(source="text", path=str(tmp_path / "a.txt"), seq_len=16, batch_size=4, val_fraction=0.1)
    dm.setup("fit")
    first = dm.train_set[0]
    assert ByteTokenizer().decode(first.tolist()) == text[:17]
    assert ByteTokenizer().decode(dm.val_set[0].tolist()) == text[int(len(text) * 0.9) :][:17]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("size", [64, 67])
def test_sharding_loses_and_duplicates_nothing(world, size):
    dataset = list(range(size))
    shards = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(dataset, num_replicas=world, rank=rank, seed=1)
        sampler.set_epoch(2)
        shards.append(list(sampler))
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)), "a sample was given to two ranks"
    assert len(seen) == size - size % world, "only the uneven tail may be dropped"
    assert len({len(s) for s in shards}) == 1, "ranks must get equal shares or a collective would hang"


def test_shuffle_depends_on_seed_and_epoch_only():
    def order(seed, epoch):
        sampler = ResumableDistributedSampler(list(range(50)), seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert sorted(order(1, 0)) == list(range(50))


def test_resume_skips_consumed_samples_of_that_epoch_only():
    sampler = ResumableDistributedSampler(list(range(40)), num_replicas=2, rank=1, seed=0)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.resume(epoch=3, samples=6)
    # The length stays the full epoch: Lightning counts the resumed batches itself (see the class docstring).
    assert len(sampler) == len(full)
    assert list(sampler) == full[6:]
    assert list(sampler) == full, "the skip applies to one pass only"
    sampler.resume(epoch=5, samples=6)
    assert list(sampler) == full, "a resume position for another epoch is ignored"


def test_vocabulary_scan_reads_all_small_corpora_and_evenly_spaced_chunks_of_large_ones():
    from lightning_llm.data.datamodule import _max_token

    tokens = np.zeros(64, dtype=np.uint32)
    tokens[33] = 9
    assert _max_token(tokens, chunk=4) == 9  # under the limit: every token is read
    # Past the limit (8 tokens = 2 chunks of 4): chunks 0-3 and 32-35 are read, so 33 is found...
    assert _max_token(tokens, chunk=4, limit=8) == 9
    tokens[33], tokens[20] = 0, 7
    # ...and an id outside the sampled chunks is not: the cost stays bounded by the limit.
    assert _max_token(tokens, chunk=4, limit=8) == 0
