"""A synthetic corpus whose loss floor is known: documents drawn from a first-order Markov chain over words.

Why: a format comparison needs a reference point. For this source the best achievable next-token loss
(cross-entropy in nats per predicted token) is computable exactly, so a run's distance to the floor is
meaningful and the same for every machine. Nothing is downloaded: corpus and tokenizer are made here,
deterministically from a seed, in a second or two.

The chain: ``vocab_words`` words; each word has ``branching`` successors with Zipf(1) probabilities over a
random choice of successors. Documents are ``doc_words`` words long, the first drawn from the stationary
distribution ``pi``. One word is one token (a word-level tokenizer), so per predicted token (the dataloader
predicts every word and the closing EOS, but not the BOS):

    floor = (H(pi) + (doc_words - 1) * sum_i pi_i H(P_i) + 0) / (doc_words + 1)

the EOS being certain at a fixed document length (the model sees per-document positions).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class MarkovCorpusSpec:
    """What defines the corpus; two equal specs give byte-identical files."""

    vocab_words: int = 512
    """Number of distinct words (tokens, besides BOS/EOS/UNK)."""
    branching: int = 16
    """Successors per word; the per-step entropy is at most log(branching)."""
    doc_words: int = 64
    """Words per document (fixed, so EOS is predictable)."""
    train_docs: int = 6000
    """Documents in the training split."""
    validation_docs: int = 200
    """Documents in the validation split (same chain, other draws)."""
    seed: int = 1234
    """Seed of the chain and of the draws."""


def _words(n: int, rng: np.random.Generator) -> list[str]:
    # Pronounceable, distinct, lowercase: consonant-vowel syllables, 2-3 of them.
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        k = int(rng.integers(2, 4))
        w = "".join(
            _CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
            for _ in range(k)
        )
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def transition_matrix(spec: MarkovCorpusSpec) -> np.ndarray:
    """The chain's row-stochastic matrix P, shape (V, V), float64."""
    rng = np.random.default_rng(spec.seed)
    V, b = spec.vocab_words, spec.branching
    zipf = 1.0 / np.arange(1, b + 1)
    zipf /= zipf.sum()
    P = np.zeros((V, V))
    for i in range(V):
        P[i, rng.choice(V, size=b, replace=False)] = zipf
    return P


def stationary(P: np.ndarray, iters: int = 2000) -> np.ndarray:
    """Stationary distribution of P by power iteration (the chain is irreducible with overwhelming odds)."""
    pi = np.full(P.shape[0], 1.0 / P.shape[0])
    for _ in range(iters):
        pi = pi @ P
    return pi / pi.sum()


def _entropy(p: np.ndarray) -> np.ndarray:
    # Entropy in nats along the last axis, 0 log 0 = 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=-1)


def loss_floor(spec: MarkovCorpusSpec) -> float:
    """The best achievable mean next-token cross-entropy (nats) on this source, as in the module docstring."""
    P = transition_matrix(spec)
    pi = stationary(P)
    rate = float(pi @ _entropy(P))
    return (float(_entropy(pi)) + (spec.doc_words - 1) * rate) / (spec.doc_words + 1)


def sample_documents(spec: MarkovCorpusSpec, n_docs: int, stream: int) -> list[str]:
    """Draw ``n_docs`` documents; ``stream`` selects an independent draw (0 = train, 1 = validation)."""
    P = transition_matrix(spec)
    cdf = np.cumsum(P, axis=1)
    pi_cdf = np.cumsum(stationary(P))
    words = np.array(_words(spec.vocab_words, np.random.default_rng(spec.seed + 1)))
    rng = np.random.default_rng([spec.seed, stream])
    u = rng.random((n_docs, spec.doc_words))
    ids = np.empty((n_docs, spec.doc_words), dtype=np.int64)
    ids[:, 0] = np.minimum(np.searchsorted(pi_cdf, u[:, 0]), spec.vocab_words - 1)
    for t in range(1, spec.doc_words):
        rows = cdf[ids[:, t - 1]]  # (n_docs, V)
        ids[:, t] = np.minimum((rows < u[:, t : t + 1]).sum(axis=1), spec.vocab_words - 1)
    return [" ".join(row) for row in words[ids]]


def _train_tokenizer(docs: list[str], folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=[BOS, EOS, UNK], min_frequency=1))
    tok.save(str(folder / "tokenizer.json"))
    cfg = {
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _write_split(folder: Path, name: str, docs: list[str]) -> None:
    with open(folder / f"{name}.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")


def build_corpus(folder: str | os.PathLike, spec: MarkovCorpusSpec = MarkovCorpusSpec()) -> Path:
    """Write ``train.jsonl``, ``validation.jsonl``, ``tokenizer.json``, ``tokenizer_config.json`` and
    ``corpus.json`` (spec + loss floor) into ``folder``, unless an identical corpus is already there.

    Safe when several ranks call it at once: each builds in a temporary folder and renames it into place.

    Returns:
        The folder.
    """
    folder = Path(folder)
    info = {"spec": asdict(spec), "loss_floor_nats": loss_floor(spec), "format": 1}
    if _is_built(folder, info):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    train = sample_documents(spec, spec.train_docs, stream=0)
    _write_split(tmp, "train", train)
    _write_split(tmp, "validation", sample_documents(spec, spec.validation_docs, stream=1))
    _train_tokenizer(train, tmp)
    (tmp / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    try:
        os.rename(tmp, folder)
    except OSError:  # another rank won the race, or an older corpus is in the way
        if _is_built(folder, info):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            _replace(tmp, folder)
    return folder


def _is_built(folder: Path, info: dict) -> bool:
    try:
        return json.loads((folder / "corpus.json").read_text()) == info
    except (OSError, ValueError):
        return False


def _replace(tmp: Path, folder: Path) -> None:
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
