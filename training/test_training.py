"""The demo policy's training contexts (train.py): what the model is taught; the tokenizer trainer.

Built from a real expert episode with DART noise and held random commands, tokenized by the
shipped tokenizer, the way the training run builds them.
"""

from pathlib import Path
import sys

import numpy as np
import pytest

from rt_llm_node.demo.episodes import expert_episode
from rt_llm_node.demo.episodes import system_ids
from rt_llm_node.demo.task import model_aim
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # training/, beside this test

import train  # noqa: E402,I100


def _find(seq, sub):
    """Start indices of ``sub`` inside ``seq``."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub]


def _runs(labels):
    """(start, end) of each run of supervised positions."""
    runs, start = [], None
    for i, x in enumerate(list(labels) + [-100]):
        if x != -100 and start is None:
            start = i
        elif x == -100 and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.fixture(scope='module')
def data():
    tokenizer = load_checkpoint(default_model_path()).tokenizer
    episode = expert_episode(7, tokenizer, noise=(0.2, 0.6), hold_rate=0.05)
    episode.goal_starts = [t for t, tick in enumerate(episode.ticks)
                           if any(s[0] == 'instruction' for s in tick.segments)]
    return episode, system_ids(tokenizer)


def _instruction_at(episode, end):
    for t in range(end, -1, -1):
        found = [s[2] for s in episode.ticks[t].segments if s[0] == 'instruction']
        if found:
            return t, found[0]
    return None


def test_contexts_keep_the_rules_the_bounded_cache_keeps(data):
    episode, system = data
    rng = np.random.default_rng(0)
    copied_differs = 0
    for _ in range(60):
        end = int(rng.integers(len(episode.ticks)))
        budget = int(rng.choice(train.BUDGETS))
        ids, labels, _ = train.build_sample(episode, system, end, budget, rng)
        assert len(ids) == len(labels)
        assert ids[:len(system)] == system                    # the pinned system prompt
        runs = _runs(labels)
        if not runs:   # the newest tick alone did not fit: the trainer retries larger
            continue
        assert len(ids) <= budget
        # the instruction in force at ``end``, once, before every supervised action
        t_instr, instr = _instruction_at(episode, end)
        where = _find(ids, instr)
        assert len(where) == 1 and where[0] < runs[0][0]
        # the context ends with the newest tick's clean expert action, its prefix not taught
        tick = episode.ticks[end]
        n = tick.n_prefix
        assert ids[-len(tick.action_ids):] == tick.action_ids
        assert labels[-len(tick.action_ids):] == [-100] * n + tick.action_ids[n:]
        # every supervised run is the clean expert command of some tick since the
        # instruction (never the noisy command the context shows there)
        taught = {tuple(episode.ticks[t].action_ids[n:]) for t in range(t_instr, end + 1)}
        for a, b in runs:
            assert tuple(labels[a:b]) in taught
            copied_differs += labels[a:b] != ids[a:b]
    # with DART noise and held commands, some labels differ from what the context shows
    assert copied_differs > 0


def test_batches_depend_on_the_round_and_step_only(data):
    episode, system = data
    train._EPISODES, train._SYSTEM = [episode], system
    try:
        a = train._build_batch((0, 1, 5, 4))
        b = train._build_batch((0, 1, 5, 4))
        c = train._build_batch((0, 1, 6, 4))
        d = train._build_batch((0, 2, 5, 4))
    finally:
        train._EPISODES = train._SYSTEM = None
    ids, labels, attention, _, layout = a
    assert layout is None   # no stale rows (--stale-ticks) in this batch
    assert ids.shape == labels.shape == attention.shape and ids.shape[0] == 4
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for other in (c, d):   # another step, or the same step of another round
        assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, other))
    # padding is masked and never taught
    assert np.all(labels[attention == 0] == -100)
    assert np.all(ids[attention == 0] == 0)
    # with --keyframe-weight the same batch comes with its loss weights
    train._EPISODES, train._SYSTEM = [episode], system
    train._KEYFRAME = 2.0
    try:
        weighted = train._build_batch((0, 1, 5, 4))
    finally:
        train._EPISODES = train._SYSTEM = None
        train._KEYFRAME = 1.0
    assert all(np.array_equal(x, y) for x, y in zip(a, weighted[:3]))
    weights = weighted[3]
    assert weights.dtype == np.float32 and weights.shape == labels.shape
    assert np.array_equal(weights > 0, labels != -100)
    assert set(np.unique(weights[labels != -100])) <= {1.0, 2.0}


def _weighted_samples(episode, system, **weight):
    """(end, plain sample, weighted sample) for 40 seeds.

    The loss weights (keyframe_weight=, distractor_weight=) change no context (no extra random
    draws), only the weights.
    """
    for seed in range(40):
        end = int(np.random.default_rng(seed).integers(1, len(episode.ticks)))
        plain = train.build_sample(episode, system, end, 1024,
                                   np.random.default_rng(seed))
        weighted = train.build_sample(episode, system, end, 1024,
                                      np.random.default_rng(seed), **weight)
        assert weighted[:2] == plain[:2]
        yield end, plain, weighted


def test_keyframe_weights_mark_the_ticks_whose_label_changes_the_command(data):
    """Keyframes are weighted and nothing else changes.

    --keyframe-weight: the same contexts (no extra random draws), and a loss weight per position: 0
    off the labels, K on the label of a tick whose expert command differs from the command executed
    the tick before, 1 on the others.
    """
    episode, system = data
    ticks = episode.ticks
    seen = set()
    for end, plain, (ids, labels, weights) in _weighted_samples(episode, system,
                                                                keyframe_weight=3.0):
        assert all(w == (0.0 if x == -100 else 1.0) for w, x in zip(plain[2], labels))
        assert len(weights) == len(ids)
        assert all((w == 0) == (x == -100) for w, x in zip(weights, labels))
        for a, b in _runs(labels):   # one tick's label: one weight
            assert len(set(weights[a:b])) == 1 and weights[a] in (1.0, 3.0)
            seen.add(weights[a])
        n = ticks[end].n_prefix
        changed = ticks[end].action_ids[n:] != ticks[end - 1].executed_ids[n:]
        assert weights[-1] == (3.0 if changed else 1.0)
    assert seen == {1.0, 3.0}


def test_weighted_loss_is_the_model_loss_under_unit_weights():
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (3, 12))
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 4:8] = ids[:, 4:8]
    labels[1, 10] = ids[1, 10]
    weights = (labels != -100).float()
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        ours = train.weighted_loss(model, ids, attention, labels, weights)
        assert torch.allclose(own, ours, atol=1e-6)
        # the batches are right-padded: without the mask (as the trainer runs) the same loss
        assert torch.allclose(train.weighted_loss(model, ids, None, labels, weights),
                              ours, atol=1e-6)
        # weight 3 on the second sample's labels: the mean counts them three times
        weights[1] *= 3
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels[:, 1:].reshape(-1),
                                               ignore_index=-100, reduction='none').reshape(3, 11)
        mask = labels[:, 1:] != -100
        expected = (ce[mask] * weights[:, 1:][mask]).sum() / weights[:, 1:][mask].sum()
        assert torch.allclose(train.weighted_loss(model, ids, attention, labels,
                                                  weights), expected, atol=1e-6)


def test_further_training_from_the_shipped_model_exports_a_loadable_checkpoint(tmp_path):
    """The tool end to end on the CPU, tiny.

    --init keeps the shipped tokenizer and starts from its weights (a low first loss),
    --keyframe-weight trains, the export loads in numpy.
    """
    pytest.importorskip('torch')
    pytest.importorskip('transformers')
    import json
    import subprocess
    from rt_llm_node.backends.numpy_backend import NumpyBackend
    shipped = Path(default_model_path())
    out = tmp_path / 'model'
    run = subprocess.run(
        [sys.executable, str(Path(train.__file__)), '--init', str(shipped),
         '--out', str(out), '--episodes', '4', '--steps', '3', '--batch', '2', '--workers',
         '1', '--keyframe-weight', '2', '--lr', '1e-5'],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / 'training.json').read_text())
    assert record['init'] == str(shipped) and record['keyframe_weight'] == 2.0
    assert record['aim'] is model_aim(shipped)   # the checkpoint's grammar, inherited
    assert record['steps'] == 3
    assert record['rounds'][0]['final_loss'] < 1.0   # from scratch it starts near ln(1280)
    assert (out / 'tokenizer.json').read_bytes() == (shipped / 'tokenizer.json').read_bytes()
    backend = NumpyBackend(load_checkpoint(out), 64)
    backend.prefill([1, 2, 3])
    assert np.isfinite(backend.logits()).all()


def test_size_sets_the_shape_of_a_from_scratch_model_and_rejects_bad_shapes(tmp_path):
    """--size HIDDEN,LAYERS,HEADS,INTERMEDIATE reaches config.json (tiny CPU run).

    Shapes the loader could not run, or a --size beside --init, are refused before any work starts.
    """
    pytest.importorskip('torch')
    pytest.importorskip('transformers')
    import json
    import subprocess
    tool = str(Path(train.__file__))
    for bad in (['--size', '100,2,2,128'], ['--size', '96,2,3,128'], ['--size', '64,2,2'],
                ['--size', '64,2,2,128', '--init', str(default_model_path())],
                ['--size', '128,2,4,128', '--kv-heads', '3'], ['--kv-heads', '0'],
                ['--short-first', '-1']):
        run = subprocess.run([sys.executable, tool, '--out', str(tmp_path / 'x'), *bad],
                             capture_output=True, text=True, timeout=120)
        option = [a for a in bad if a.startswith('--') and a != '--init'][-1]
        assert run.returncode == 2 and option in run.stderr, (bad, run.stderr[-500:])
        assert not (tmp_path / 'x').exists()
    out = tmp_path / 'model'
    run = subprocess.run(
        [sys.executable, tool, '--size', '64,2,2,128', '--kv-heads', '2', '--short-first', '1',
         '--out', str(out), '--episodes', '4', '--steps', '2', '--batch', '2', '--workers', '1'],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads((out / 'config.json').read_text())
    assert (config['hidden_size'], config['num_hidden_layers'], config['num_attention_heads'],
            config['num_key_value_heads'], config['intermediate_size']) == (64, 2, 2, 2, 128)
    record = json.loads((out / 'training.json').read_text())
    assert (record['kv_heads'], record['short_first']) == (2, 1)
    from rt_llm_node.backends.numpy_backend import NumpyBackend
    backend = NumpyBackend(load_checkpoint(out), 32)
    backend.prefill([1, 2, 3])
    assert np.isfinite(backend.logits()).all()


def test_short_first_steps_draw_the_shortest_budgets(data):
    """Short contexts come first.

    --short-first N: round 0's first N batches come from the 128 and 192-token budgets (a context
    at most that wide, but where the newest tick alone is wider), later steps and later rounds from
    all of them.
    """
    episode, system = data
    train._EPISODES, train._SYSTEM = [episode], system
    train._SHORT_FIRST = 30
    try:
        short = [train._build_batch((0, 0, step, 4))[0].shape[1]
                 for step in range(30)]
        later = [train._build_batch((0, 0, step, 4))[0].shape[1]
                 for step in range(30, 60)]
        round1 = [train._build_batch((0, 1, step, 4))[0].shape[1]
                  for step in range(30)]
    finally:
        train._EPISODES = train._SYSTEM = None
        train._SHORT_FIRST = 0
    assert max(short) <= 192, short
    assert max(later) > 192 and max(round1) > 192, (later, round1)


def test_distractor_ticks_are_flagged_and_weighted(data):
    """Distractor ticks are marked and weighted.

    TickTokens.distractor marks the ticks whose target is 30 deg or more off the heading with
    another object within 15 deg of it (read back from the rendered detections), and
    --distractor-weight multiplies the loss weight of exactly those ticks' labels.
    """
    from rt_llm_node.demo.expert import parse_detections
    from rt_llm_node.demo.expert import parse_instruction
    episode, system = data
    tokenizer = load_checkpoint(default_model_path()).tokenizer
    instruction, flagged = None, 0
    for tick in episode.ticks:
        texts = {topic: tokenizer.decode(ids) for _, topic, ids in tick.segments}
        if '/instruction' in texts:
            instruction = texts['/instruction']
        target = parse_instruction(instruction)
        found = parse_detections(texts.get('/detections', ''))
        seen = [d for d in found if d[:2] == target]
        expected = bool(seen) and abs(seen[0][2]) >= 30 and any(
            d[:2] != target and abs(d[2]) <= 15 for d in found)
        assert tick.distractor == expected
        flagged += expected
    assert 0 < flagged < len(episode.ticks)
    ticks = episode.ticks
    for end, _, (ids, labels, weights) in _weighted_samples(episode, system,
                                                            distractor_weight=4.0):
        assert weights[-1] == (4.0 if ticks[end].distractor else 1.0)
        assert all(w in (0.0, 1.0, 4.0) and (w == 0) == (x == -100)
                   for w, x in zip(weights, labels))


def test_online_dagger_adds_the_rollouts_of_the_newest_weights_while_training(tmp_path):
    """--online-dagger end to end on the CPU, tiny.

    Rollouts of snapshots land during the one training run, their expert-labelled episodes join the
    data (training.json counts them), and the export loads in numpy; with --dagger-rounds it is
    refused before any work.
    """
    pytest.importorskip('torch')
    pytest.importorskip('transformers')
    import json
    import subprocess
    tool = str(Path(train.__file__))
    run = subprocess.run([sys.executable, tool, '--out', str(tmp_path / 'x'), '--online-dagger',
                          '0.1', '--dagger-rounds', '1', '--max-minutes', '1'],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and '--online-dagger' in run.stderr, run.stderr[-500:]
    out = tmp_path / 'model'
    run = subprocess.run(
        [sys.executable, tool, '--size', '64,1,2,128', '--out', str(out), '--episodes', '4',
         '--steps', '100000', '--batch', '2', '--workers', '1', '--online-dagger', '0.0',
         '--dagger-workers', '1', '--dagger-episodes', '1', '--dagger-ticks', '8',
         '--max-minutes', '0.8'],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / 'training.json').read_text())
    iterations = record['rounds'][0]['online_dagger']['iterations']
    assert iterations, run.stdout[-2000:]
    assert record['episodes'] == 4 + len(iterations)      # one rollout an iteration
    seeds = [it['seeds'] for it in iterations]
    # fresh seeds each time, never an iteration twice (past the cap on iterations, none)
    assert seeds[0] == [4, 4] and all(b[0] == a[1] + 1 for a, b in zip(seeds, seeds[1:]))
    assert len(iterations) <= train.ONLINE_DAGGER_MAX_ITERATIONS
    assert all(it['ticks'] == 8 for it in iterations)
    from rt_llm_node.backends.numpy_backend import NumpyBackend
    backend = NumpyBackend(load_checkpoint(out), 32)
    backend.prefill([1, 2, 3])
    assert np.isfinite(backend.logits()).all()


def test_counterfactual_contexts_name_another_object_and_teach_its_expert_command():
    """Counterfactual labels name each object in view.

    --counterfactual: episodes carry, per tick, the expert's command had the instruction named each
    other detected object (the robot drives the same, the labels and shown actions are unchanged);
    a counterfactual context shows that object's instruction in place of the real one (drawn
    uniformly, the real one as often as each other), and its newest label is the expert's command
    for the instruction shown, recomputed here on the world replayed to that tick.
    """
    from rt_llm_node.codec import scan_sectors
    from rt_llm_node.demo.episodes import SCAN_SECTORS
    from rt_llm_node.demo.expert import expert_command
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.demo.world import DemoWorld
    tokenizer = load_checkpoint(default_model_path()).tokenizer
    plain = expert_episode(7, tokenizer, noise=(0.2, 0.6), hold_rate=0.05)
    episode = expert_episode(7, tokenizer, noise=(0.2, 0.6), hold_rate=0.05,
                             counterfactual=True)
    assert episode.results == plain.results
    assert [(t.action_ids, t.executed_ids) for t in episode.ticks] == \
        [(t.action_ids, t.executed_ids) for t in plain.ticks]
    assert plain.instructions is None and all(t.alternatives is None for t in plain.ticks)
    assert len(episode.instructions) == 9
    episode.goal_starts = [t for t, tick in enumerate(episode.ticks)
                           if any(s[0] == 'instruction' for s in tick.segments)]
    # the world replayed with the executed commands: each tick's scan and detections
    executed = [[float(w[1:]) for w in tokenizer.decode(t.executed_ids).split()[1:]]
                for t in episode.ticks]
    world = DemoWorld(7, messages=MessageFactory(ros=False))
    seen = []
    for v, w in executed:
        msgs = world.observe()
        seen.append((scan_sectors(msgs['/scan'], SCAN_SECTORS), msgs['/detections'].data))
        world.step(v, w)
    assert world.results == episode.results
    system = system_ids(tokenizer)
    grammar = action_grammar(tokenizer)
    fv, fw = grammar.field('linear.x'), grammar.field('angular.z')
    instructions = {tuple(ids): name for name, ids in episode.instructions.items()}
    rng = np.random.default_rng(0)
    changed = reals = 0
    for _ in range(60):
        end = int(rng.integers(episode.goal_starts[0] + 1, len(episode.ticks)))
        ids, labels, _ = train.build_sample(episode, system, end, 1024, rng,
                                            counterfactual=1.0)
        shown = [name for key, name in instructions.items() if _find(ids, list(key))]
        assert len(shown) == 1
        name = shown[0]
        _, real = _instruction_at(episode, end)
        if _find(ids, real):   # drawn like any other object in view: the real one
            reals += 1
            assert labels[-4:] == [-100] + episode.ticks[end].action_ids[1:]
            continue
        assert name in episode.ticks[end].alternatives
        sectors, detections = seen[end]
        assert f'{name[0]} {name[1]} ' in detections
        v, w = expert_command(f'go to the {name[0]} {name[1]}', sectors, detections,
                              executed[end - 1][1])
        tick = episode.ticks[end]
        assert ids[-len(tick.action_ids):] == tick.alternatives[name]   # shown and taught
        taught = tokenizer.decode([x for x in labels[-4:] if x != -100]).split()
        assert taught == [fv.text(fv.quantize(v)), fw.text(fw.quantize(w))], (taught, v, w)
        changed += tick.action_ids != tick.alternatives[name]
    assert changed >= 20 and 3 <= reals <= 25, (changed, reals)
    # without the option the same call draws nothing more: the contexts of old runs stay
    a = train.build_sample(episode, system, 300, 512, np.random.default_rng(1))
    b = train.build_sample(plain, system, 300, 512, np.random.default_rng(1))
    assert a == b


@pytest.fixture(scope='module')
def aiming():
    """Build an aiming episode and its tokenizer.

    An aiming episode with counterfactual labels and a tokenizer that keeps each object name,
    bearing and action word one token (train --aim --object-tokens).
    """
    from rt_llm_node.demo.episodes import episode_texts
    from rt_llm_node.demo.task import object_phrases
    from rt_llm_node.demo.task import whole_words
    from tokenizer import train_tokenizer
    texts = [line for seed in range(3) for line in episode_texts(seed)]
    tokenizer = train_tokenizer(texts, train.MODEL['vocab_size'],
                                whole_words=whole_words(True), phrases=object_phrases())
    episode = expert_episode(7, tokenizer, noise=(0.2, 0.6), hold_rate=0.05, aim=True,
                             aim_noise=45.0, counterfactual=True)
    episode.goal_starts = [t for t, tick in enumerate(episode.ticks)
                           if any(s[0] == 'instruction' for s in tick.segments)]
    return episode, system_ids(tokenizer), tokenizer


def _lines(tokenizer, ids, prefix):
    return [line for line in tokenizer.decode(ids).split('\n') if line.startswith(prefix)]


def test_sparse_detections_keep_the_instructed_object_and_its_expert_command(aiming):
    """Sparse detections keep the instructed object.

    --sparse-detections: the newest detections line shows the instructed object's entry as it was
    and 0-2 of the others in their order, rendered by the node's codec; the expert's command read
    from the thinned line is the one from the full line, and the aim taught is the full line's, so
    the label stays exact. Older lines are shown whole.
    """
    from rt_llm_node.codec import ObservationCodec
    from rt_llm_node.demo.expert import expert_aim
    from rt_llm_node.demo.expert import expert_command
    from rt_llm_node.demo.expert import parse_instruction
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.demo.task import INPUTS
    episode, system, tokenizer = aiming
    aim = action_grammar(tokenizer, aim=True).field('_aim')
    sparse = train.SparseDetections(tokenizer)
    codec = ObservationCodec(tokenizer, INPUTS)
    shown = {_lines(tokenizer, segment, 'det')[0] for tick in episode.ticks
             for _, topic, segment in tick.segments if topic == '/detections'}
    rng = np.random.default_rng(3)
    sizes = set()
    thinned = 0
    for _ in range(80):
        end = int(rng.integers(episode.goal_starts[0] + 1, len(episode.ticks)))
        ids, labels, _ = train.build_sample(
            episode, system, end, 256, rng, counterfactual=1.0, sparse=(1.0, sparse))
        instruction = _lines(tokenizer, ids, 'task')[-1]
        newest = _lines(tokenizer, ids, 'det')[-1]
        whole = next(_lines(tokenizer, segment, 'det')[0]
                     for _, topic, segment in episode.ticks[end].segments
                     if topic == '/detections')
        target = parse_instruction(instruction)
        entries, every = newest[4:].split('; '), whole[4:].split('; ')
        mine = [e for e in every if e.startswith(f'{target[0]} {target[1]} ')]
        if newest != whole:
            thinned += 1
            assert mine and mine[0] in entries and len(entries) <= 3
            assert [e for e in every if e in entries] == entries   # order kept
            line_ids = codec.encode('/detections', MessageFactory(ros=False).string(newest[4:]))
            assert _find(ids, line_ids)
            sizes.add(len(entries))
            for sectors in ([0.4] * 12, [3.0] * 12):
                assert expert_command(instruction[5:], sectors, newest[4:], 0.5) == \
                    expert_command(instruction[5:], sectors, whole[4:], 0.5)
        else:   # the instructed object out of sight (or nothing else to drop)
            assert not mine or len(every) == 1 or len(entries) == len(every)
        # the aim taught is the one the full line gives for the instruction shown
        stated = aim.quantize(expert_aim(instruction[5:], whole[4:]))
        assert tokenizer.decode([x for x in labels if x != -100][-4:-3]).strip() == \
            aim.text(stated)
        # older detections lines are shown whole: each is some tick's line as rendered
        assert set(_lines(tokenizer, ids, 'det')[:-1]) <= shown
    assert thinned >= 40 and sizes == {1, 2, 3}, (thinned, sizes)


def test_lookup_contexts_show_the_detections_and_teach_the_aim_alone(aiming):
    """Round 0 starts on lookup contexts.

    --lookup-first N: round 0's first N batches are lookup contexts (the instruction drawn over the
    objects in view, only the detections and actions rendered, only the stated aim taught, the
    label of the instruction shown); later steps and rounds are not. --lookup-share P keeps about P
    of each later batch so.
    """
    from rt_llm_node.demo.expert import expert_aim
    from rt_llm_node.demo.task import action_grammar
    episode, system, tokenizer = aiming
    aim = action_grammar(tokenizer, aim=True).field('_aim')
    rng = np.random.default_rng(5)
    names = set()
    for _ in range(40):
        end = int(rng.integers(episode.goal_starts[0] + 1, len(episode.ticks)))
        ids, labels, weights = train.build_sample(
            episode, system, end, train.LOOKUP_BUDGET, rng, counterfactual=1.0,
            lookup=True)
        lines = tokenizer.decode(ids).split('\n')[1:-1]
        assert lines[0].startswith('task ') and all(
            line.startswith(('det ', 'act ')) for line in lines[1:]), lines
        taught = [x for x in labels if x != -100]
        assert len(taught) == 1 and np.count_nonzero(weights) == 1
        detections = _lines(tokenizer, ids, 'det')[-1][4:]
        stated = aim.quantize(expert_aim(lines[0][5:], detections))
        assert tokenizer.decode(taught).strip() == aim.text(stated)
        names.add(lines[0])
    assert len(names) >= 4   # the instruction is drawn, not always the real one

    def lookup_rows(round_, step, share=0.0):
        train._EPISODES, train._SYSTEM = [episode], system
        train._LOOKUP_SHARE = share
        try:
            ids, labels = train._build_batch((0, round_, step, 16))[:2]
        finally:
            train._EPISODES = train._SYSTEM = None
            train._LOOKUP_SHARE = 0.0
        return sum(int((row != -100).sum() == 1 and not _lines(tokenizer, i.tolist(), 'scan'))
                   for i, row in zip(ids, labels))
    stage = train.LOOKUP_STREAM
    assert lookup_rows(stage, 3) == 16 and lookup_rows(stage, 3, share=0.5) == 16
    assert lookup_rows(0, 3) == 0 and lookup_rows(1, 3) == 0
    assert 2 <= lookup_rows(0, 3, share=0.5) <= 14


def test_lookup_stage_stops_at_its_accuracy_or_its_steps(aiming, monkeypatch):
    """The lookup stage stops at its target or after its steps.

    --lookup-first: the stage checks the held-out aim every LOOKUP_EVERY steps and ends at the
    first check that reaches LOOKUP_DONE, else after its steps; at least LOOKUP_BATCH contexts a
    step, the constant LOOKUP_LR, the curve recorded.
    """
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    from types import SimpleNamespace
    episode, system, tokenizer = aiming
    held = train.draw_contexts(np.random.default_rng(1), [episode], system, 256, 8)
    lookup_held = train.draw_contexts(np.random.default_rng(1), [episode], system,
                                      train.LOOKUP_BUDGET, 8,
                                      lookup=True)
    assert all(int((row != -100).sum()) == 1 for row in lookup_held[1])
    assert all(int((row != -100).sum()) >= 4 for row in held[1])   # whole actions taught
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=train.MODEL['vocab_size'], hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        bos_token_id=None, eos_token_id=None))
    accuracy = train.aim_accuracy(model, *lookup_held)
    assert 0.0 <= accuracy <= 1.0
    monkeypatch.setattr(train, 'LOOKUP_EVERY', 2)
    monkeypatch.setattr(train, 'LOOKUP_BATCH', 4)
    args = SimpleNamespace(lookup_first=5, batch=2, workers=1, seed=0)
    monkeypatch.setattr(train, 'LOOKUP_DONE', 1.01)   # never reached
    before = [p.detach().clone() for p in model.parameters()]
    record = train._lookup_stage(model, [episode], system, args, 'cpu',
                                 lookup_held)
    assert record['steps'] == 5 and record['batch'] == 4
    assert record['lr'] == train.LOOKUP_LR
    assert [step for step, _ in record['accuracy']] == [2, 4, 5]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.setattr(train, 'LOOKUP_DONE', 0.0)    # reached at the first check
    record = train._lookup_stage(model, [episode], system, args, 'cpu',
                                 lookup_held)
    assert record['steps'] == 2 and len(record['accuracy']) == 1


def test_meaning_contexts_hold_what_a_full_meaning_cache_holds(aiming):
    """Meaning contexts look like a full meaning cache.

    --meaning-share: a context as a full ``meaning`` cache holds it: the system prompt, the
    instruction, older ticks' actions only (every older observation is superseded), the newest
    tick's observations whole; only the newest tick taught, within the budget; in a batch such rows
    weigh MEANING_WEIGHT, the others 1.
    """
    episode, system, tokenizer = aiming
    rng = np.random.default_rng(3)
    older_actions = 0
    for _ in range(40):
        end = int(rng.integers(episode.goal_starts[0] + 1, len(episode.ticks)))
        budget = int(rng.choice(train.MEANING_BUDGETS))
        ids, labels, weights = train.build_sample(
            episode, system, end, budget, rng, meaning=True)
        if max(labels) == -100:   # the newest tick alone outgrew the budget
            continue
        assert len(ids) <= budget and ids[:len(system)] == system
        assert len(_lines(tokenizer, ids, 'task ')) == 1
        for prefix in ('scan ', 'odom ', 'det '):   # the newest tick's, nothing older
            assert len(_lines(tokenizer, ids, prefix)) == 1, prefix
        tick = episode.ticks[end]
        n = tick.n_prefix
        assert ids[-len(tick.action_ids):] == tick.action_ids
        assert _runs(labels) == [(len(ids) - len(tick.action_ids) + n, len(ids))]
        assert np.count_nonzero(weights) == len(tick.action_ids) - n
        older_actions += len(_lines(tokenizer, ids, 'act ')) - 1
    assert older_actions > 100   # the action history reaches back

    def weighted_rows(share):
        train._EPISODES, train._SYSTEM = [episode], system
        train._MEANING_SHARE = share
        try:
            ids, labels, _, weights, _ = train._build_batch((0, 0, 3, 32))
        finally:
            train._EPISODES = train._SYSTEM = None
            train._MEANING_SHARE = 0.0
        heavy = 0
        for i, lab, w in zip(ids, labels, weights):
            taught = set(np.unique(w[lab != -100]).tolist())
            assert taught in ({1.0}, {train.MEANING_WEIGHT}, set())
            if taught == {train.MEANING_WEIGHT}:
                heavy += 1
                assert len(_lines(tokenizer, i.tolist(), 'scan ')) == 1
        return heavy
    assert weighted_rows(0.0) == 0
    assert 4 <= weighted_rows(0.4) <= 24


def test_stale_contexts_hide_old_observations_from_later_ticks(aiming):
    """Stale ticks carry their observations for their own tokens only.

    --stale-ticks N: in a meaning context the N newest older ticks with an action shown carry their
    observations again, right before the action, seen by that tick's tokens alone (what the
    action's cached keys and values took from them), at the positions just before the action's;
    every other token sits at its compacted position; those ticks are taught too. The mask is
    causal and hides them from every later tick.
    """
    torch = pytest.importorskip('torch')
    episode, system, tokenizer = aiming
    rng = np.random.default_rng(4)
    checked = 0
    for _ in range(30):
        end = int(rng.integers(episode.goal_starts[0] + 40, len(episode.ticks)))
        ids, labels, weights, (positions, owner, tick) = train.build_sample(
            episode, system, end, 256, rng, meaning=True, stale=3)
        if max(labels) == -100:
            continue
        visible = [i for i, o in enumerate(owner) if o < 0]
        assert [positions[i] for i in visible] == list(range(len(visible)))
        assert len(visible) <= 256
        hidden_ticks = sorted({o for o in owner if o >= 0})
        assert 1 <= len(hidden_ticks) <= 3 and max(hidden_ticks) < end
        for t in hidden_ticks:
            span = [i for i, o in enumerate(owner) if o == t]
            assert span == list(range(span[0], span[-1] + 1))   # one run, before its action
            act = span[-1] + 1
            assert tick[act] == t and owner[act] == -1
            assert tokenizer.decode(ids[act:act + 1]).startswith('act')
            assert [positions[i] for i in span] == list(
                range(positions[act] - len(span), positions[act]))
            text = tokenizer.decode(ids[span[0]:act])
            assert text.startswith('scan ') and '\ndet ' in text   # the tick's observations
            assert all(x == -100 for x in labels[span[0]:act])
        # the newest tick and each hidden one are taught: one run of labels each
        assert len(_runs(labels)) == len(hidden_ticks) + 1
        att = torch.ones(1, len(ids), dtype=torch.long)
        mask = train.stale_mask(torch.tensor([owner]), torch.tensor([tick]),
                                att)[0, 0]
        for i in range(len(ids)):
            for j in (0, i // 2, i):
                want = j <= i and (owner[j] < 0 or owner[j] == tick[i])
                assert bool(mask[i, j]) == want
        first = next(i for i, o in enumerate(owner) if o >= 0)
        assert not mask[len(ids) - 1, first]   # the newest tick does not see it
        checked += 1
    assert checked >= 10
    # the batch builder carries the layout of stale rows, in order for the others
    train._EPISODES, train._SYSTEM = [episode], system
    train._MEANING_SHARE, train._STALE = 0.5, 3
    try:
        ids, labels, attention, weights, layout = train._build_batch((0, 0, 3, 16))
    finally:
        train._EPISODES = train._SYSTEM = None
        train._MEANING_SHARE, train._STALE = 0.0, 0
    assert layout is not None and layout.shape == (3,) + ids.shape
    stale_rows = [b for b in range(16) if (layout[1, b] >= 0).any()]
    assert stale_rows and len(stale_rows) < 16
    for b in set(range(16)) - set(stale_rows):
        assert np.array_equal(layout[0, b], np.arange(ids.shape[1]))


def test_the_trained_tokenizer_keeps_every_action_word_and_bearing_one_token():
    from rt_llm_node.demo.episodes import episode_texts
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.demo.task import action_words
    from rt_llm_node.demo.task import whole_words
    from tokenizer import train_tokenizer
    texts = [line for seed in range(2) for line in episode_texts(seed)]
    tokenizer = train_tokenizer(texts, 1280, whole_words=whole_words())
    assert all(len(tokenizer.encode(word).ids) == 1 for word in whole_words())
    assert set(action_words()) <= set(whole_words())
    assert ' -180deg' in whole_words() and ' 180deg' in whole_words()
    grammar = action_grammar(tokenizer)
    text = grammar.render({'linear.x': -0.2, 'angular.z': 1.25})
    assert len(tokenizer.encode(text).ids) == 4      # prefix, v, w, newline
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_object_phrases_train_to_single_tokens_alike_in_instruction_and_detections():
    from rt_llm_node.demo.episodes import episode_texts
    from rt_llm_node.demo.task import action_grammar
    from rt_llm_node.demo.task import object_phrases
    from rt_llm_node.demo.task import whole_words
    from tokenizer import train_tokenizer
    texts = [line for seed in range(2) for line in episode_texts(seed)]
    tokenizer = train_tokenizer(texts, 1280, whole_words=whole_words(), phrases=object_phrases())
    assert len(object_phrases()) == 9
    assert all(len(tokenizer.encode(word).ids) == 1 for word in whole_words() + object_phrases())
    red_box = tokenizer.encode(' red box').ids[0]
    for text in ('task go to the red box',
                 'det red ball 23deg 4.0m; blue box 37deg 2.5m; red box -16deg 4.5m'):
        ids = tokenizer.encode(text).ids
        assert ids.count(red_box) == 1 and tokenizer.decode(ids) == text
    # a phrase is whole only where it stands as words: 'red boxes' is no object
    assert red_box not in tokenizer.encode('det red boxes 3deg 1.0m').ids
    grammar = action_grammar(tokenizer)
    assert len(tokenizer.encode(grammar.render({'linear.x': 0.5, 'angular.z': -0.75})).ids) == 4
    # without phrases, colour and shape stay two tokens
    plain = train_tokenizer(texts, 1280, whole_words=whole_words())
    assert len(plain.encode(' red box').ids) == 2
