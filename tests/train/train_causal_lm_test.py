"""The causal LM recipe: character data and its split, the causal model and loss, exact resume."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds

import simigrad_jax
from train import char_data
from train import input_pipeline
from train import models
from train import tasks
from train import text_data
from train import train
from train.configs import shakespeare_lm

# Where the recipe reads tinyshakespeare: its local_data_dir (../shared/data) from the
# repository root, resolved as the recipe resolves it (a symlinked ../shared included).
SHARED_TEXT = char_data.local_text_path(shakespeare_lm.get_config().local_data_dir)
WORDS = ("the", "king", "and", "queen", "of", "rome", "shall", "speak", "now", "my", "lord")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  """About 20,000 characters of generated text (the code path that runs without the data file)."""
  rng = np.random.default_rng(0)
  path = tmp_path_factory.mktemp("text") / "generated.txt"
  path.write_text(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 4000)) + "\n")
  return path


def tiny_config(text_file, **overrides):
  config = shakespeare_lm.get_config()
  config.update(
    text_files=str(text_file),
    seq_length=16,
    bert_hidden=16,
    bert_heads=2,
    bert_mlp=32,
    bert_layers=1,
    eval_examples=32,
    eval_batch_size=32,
    initial_batch_size=16,
    batch_size_lower_bound=8,
    batch_size_upper_bound=64,
    max_micro_batch_size=8,
    mode="pad",
    progress=False,
    tensorboard=False,
    plot=False,
    compilation_cache=False,
  )
  config.update(overrides)
  return config


def test_vocabulary_windows_and_split(text_file):
  text = text_file.read_text()
  datasets = char_data.load_chars(tiny_config(text_file))
  vocabulary = datasets.vocabulary
  assert vocabulary.chars == "".join(sorted(set(text))) and datasets.vocab_size == vocabulary.size
  held_out = int(len(text) * 0.1)
  train_text, val_text = text[: len(text) - held_out], text[len(text) - held_out :]
  # Windows of 17 characters that overlap by one: every character but the first is a target once.
  windows = datasets.train.get_batch(np.arange(len(datasets.train)))["tokens"]
  assert windows.shape[1] == 17
  assert len(datasets.train) == (len(train_text) - 1) // 16
  assert vocabulary.decode(windows[:, 1:]) == train_text[1 : 1 + 16 * len(datasets.train)]
  assert all(windows[i, -1] == windows[i + 1, 0] for i in range(len(windows) - 1))
  first_val = datasets.eval.get_batch(np.array([0]))["tokens"]
  assert vocabulary.decode(first_val) == val_text[:17]
  padded = datasets.train.get_batch(np.array([-1, 0]))["tokens"]
  assert not padded[0].any() and datasets.train.element_spec["tokens"][0] == (17,)
  # The unigram entropy of the training text, in nats.
  counts = np.array([train_text.count(c) for c in set(train_text)], np.float64)
  p = counts / counts.sum()
  assert datasets.unigram_entropy == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)
  assert datasets.tokens_per_example == 16
  with pytest.raises(ValueError, match=r"character 'Z' is not in the vocabulary of"):
    vocabulary.encode("Zed")


def test_missing_file_names_where_it_looked_and_the_options(tmp_path, text_file):
  config = tiny_config(text_file, text_files="", text_source="local", local_data_dir=str(tmp_path))
  with pytest.raises(
    FileNotFoundError,
    match=rf"tinyshakespeare.txt is not in '{tmp_path}': set "
    r"--config.local_data_dir",
  ):
    char_data.load_chars(config)
  with pytest.raises(ValueError, match=r"config.text_source='web' is not valid; choose one of"):
    char_data.load_chars(tiny_config(text_file, text_files="", text_source="web"))
  # "auto" without the file goes to TFDS tiny_shakespeare (here its mock data).
  config.text_source, config.seq_length = "auto", 4
  with tfds.testing.mock_data(num_examples=4):
    datasets = char_data.load_chars(config)
  assert "TFDS tiny_shakespeare" in datasets.description and len(datasets.eval) >= 1


@pytest.mark.skipif(not SHARED_TEXT.is_file(), reason=f"no {SHARED_TEXT}")
def test_tinyshakespeare_split_and_unigram_entropy():
  config = shakespeare_lm.get_config()
  datasets = char_data.load_chars(config)
  assert datasets.vocab_size == 65 and str(SHARED_TEXT) in datasets.description
  assert datasets.unigram_entropy == pytest.approx(3.309, abs=1e-3)
  assert len(datasets.train) == (1_115_394 - 111_539 - 1) // 64


def test_the_model_is_causal_and_the_loss_is_nats_per_token(text_file):
  config = tiny_config(text_file)
  datasets = char_data.load_chars(config)
  model = models.create_model(config, vocab_size=datasets.vocab_size)
  tokens = jnp.asarray(datasets.train.get_batch(np.arange(4))["tokens"])
  params = model.init(jax.random.key(0), tokens[:, :-1], train=False)["params"]
  logits = model.apply({"params": params}, tokens[:, :-1], train=False)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % datasets.vocab_size)
  logits_changed = model.apply({"params": params}, changed[:, :-1], train=False)
  np.testing.assert_allclose(logits[:, :8], logits_changed[:, :8], atol=1e-5)  # the past only
  assert not np.allclose(logits[:, 8:], logits_changed[:, 8:], atol=1e-3)
  loss_fn, _, eval_step = tasks.causal_lm_fns(config, model, datasets)
  per_example, _ = loss_fn(params, None, {"tokens": tokens}, jnp.ones(4), jax.random.key(1))
  expected = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(-1)
  np.testing.assert_allclose(per_example, expected, rtol=1e-5)
  # Untrained, about log(vocabulary) nats per token; the padding row weighs nothing.
  weights = jnp.array([1.0, 1.0, 1.0, 0.0])
  correct, total, count = eval_step({"params": params}, {"tokens": tokens}, weights)
  assert float(count) == 3 * 16 and float(total) / 48 == pytest.approx(
    float(expected[:3].mean()), 1e-5
  )
  assert abs(float(total) / 48 - math.log(datasets.vocab_size)) < 0.5


def _records(workdir):
  return [r for r in simigrad_jax.read_metrics(workdir / "metrics.jsonl") if "batch_size" in r]


def test_trains_below_the_unigram_entropy_and_resumes_exactly_mid_ramp(
  tmp_path, text_file, devices
):
  """Six steps at once, and three then three more from the checkpoint: the same steps exactly."""
  config = tiny_config(text_file, learning_rate=1e-2, warmup_epochs=0.0, checkpoint_every_steps=1)
  straight, stopped = tmp_path / "straight", tmp_path / "stopped"
  with train.create_trainer(train.create_experiment(config, devices=devices), straight) as t:
    summary = t.train(num_steps=6)
  for steps in (3, 6):
    with train.create_trainer(train.create_experiment(config, devices=devices), stopped) as t:
      t.train(num_steps=steps)
  a, b = _records(straight), _records(stopped)
  assert [r["step"] for r in b] == list(range(1, 7))
  sizes = [r["batch_size"] for r in a]
  assert len(set(sizes)) > 1  # the batch size moved: the resume lands mid-ramp
  assert sizes == [r["batch_size"] for r in b]
  assert [r["loss"] for r in a] == [r["loss"] for r in b]
  assert [r["similarity"] for r in a] == [r["similarity"] for r in b]
  assert summary["loss"] < math.log(char_data.load_chars(config).vocab_size)


def test_a_resume_on_a_changed_text_is_refused_naming_its_digest(tmp_path, text_file, devices):
  """The same file name, characters and length, the words in another order: once resumed
  silently, on other windows (and, with other characters, on other token ids)."""
  words = text_file.read_text().split()
  mine = tmp_path / "mine.txt"
  mine.write_text(" ".join(words) + "\n")
  config = tiny_config(mine, checkpoint_every_steps=1)
  with train.create_trainer(train.create_experiment(config, devices=devices), tmp_path / "w") as t:
    t.train(num_steps=1)
  recorded = text_data.text_sha256(mine.read_text())
  mine.write_text(" ".join(reversed(words)) + "\n")
  with pytest.raises(ValueError, match=rf"text_sha256: '{recorded}' there, '[0-9a-f]{{16}}' here"):
    train.create_trainer(train.create_experiment(config, devices=devices), tmp_path / "w")


def test_python_m_train_summary_reports_tokens_and_the_validation_loss(
  tmp_path, text_file, devices
):
  config = tiny_config(text_file, num_epochs=1.0, initial_batch_size=32, learning_rate=1e-2)
  summary = train.train_and_evaluate(config, tmp_path)
  datasets = input_pipeline.create_datasets(config)
  assert summary["tokens_seen"] == len(datasets.train) * 16 == summary["examples_seen"] * 16
  assert summary["tokens_per_second"] > 0 and summary["eval_loss_unit"] == "nats/token"
  assert (
    summary["eval_loss"] < summary["unigram_entropy"] == pytest.approx(datasets.unigram_entropy)
  )
