"""The synthetic corpus: deterministic, one token per word, and a loss floor that matches the data."""

import json

import numpy as np
from tokenizers import Tokenizer

from low_bits_training.data.markov import (
    MarkovCorpusSpec,
    build_corpus,
    loss_floor,
    stationary,
    transition_matrix,
)

SMALL = MarkovCorpusSpec(
    vocab_words=40, branching=4, doc_words=16, train_docs=3000, validation_docs=10, seed=7
)


def test_same_spec_same_bytes_other_seed_other_bytes(tmp_path):
    a = build_corpus(tmp_path / "a", SMALL)
    b = build_corpus(tmp_path / "b", SMALL)
    c = build_corpus(tmp_path / "c", MarkovCorpusSpec(**{**SMALL.__dict__, "seed": 8}))
    assert (a / "train.jsonl").read_bytes() == (b / "train.jsonl").read_bytes()
    assert (a / "train.jsonl").read_bytes() != (c / "train.jsonl").read_bytes()


def test_tokenizer_gives_one_token_per_word_and_round_trips(tmp_path):
    folder = build_corpus(tmp_path / "m", SMALL)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    doc = json.loads((folder / "train.jsonl").read_text().splitlines()[0])["text"]
    ids = tok.encode(doc).ids
    assert len(ids) == SMALL.doc_words and tok.get_vocab_size() == SMALL.vocab_words + 3
    assert tok.decode(ids) == doc


def test_floor_matches_the_empirical_conditional_entropy(tmp_path):
    # Plug-in estimate of H(first word) + H(next | previous) from the generated text, against the formula.
    folder = build_corpus(tmp_path / "m", SMALL)
    docs = [json.loads(x)["text"].split() for x in (folder / "train.jsonl").read_text().splitlines()]
    vocab = {w: i for i, w in enumerate(sorted({w for d in docs for w in d}))}
    ids = np.array([[vocab[w] for w in d] for d in docs])
    V = len(vocab)
    counts = np.zeros((V, V))
    np.add.at(counts, (ids[:, :-1].ravel(), ids[:, 1:].ravel()), 1)
    p_next = counts / counts.sum(1, keepdims=True).clip(min=1)
    h_trans = -(counts * np.log(np.where(p_next > 0, p_next, 1))).sum() / counts.sum()
    first = np.bincount(ids[:, 0], minlength=V) / len(ids)
    h_first = -(first[first > 0] * np.log(first[first > 0])).sum()
    empirical = (h_first + (SMALL.doc_words - 1) * h_trans) / (SMALL.doc_words + 1)
    assert abs(empirical - loss_floor(SMALL)) < 0.02


def test_stationary_distribution_is_fixed_point():
    P = transition_matrix(SMALL)
    pi = stationary(P)
    np.testing.assert_allclose(pi @ P, pi, atol=1e-12)
    np.testing.assert_allclose(P.sum(1), 1.0)
