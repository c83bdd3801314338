"""rt-llm-replay-fleet: a fleet of demo bags replayed on a local Ray cluster.

Bags of different seeds, one corrupt, one whose golden was made with another parameter: the
report names the corrupt one (the others' results kept), diffs the changed one at its first
differing tick, and says the rest are the same; each bag's decisions are those of a
single-bag rt-llm-replay, whatever the number of workers; --resume replays nothing twice.
"""

import json
from pathlib import Path
import shutil
import subprocess
import sys

import pytest

from rt_llm_node import fleet
from rt_llm_node.replay import load_params
from rt_llm_node.replay import read_cost_model
from rt_llm_node.replay import replay

pytest.importorskip('rosbags', reason='rosbags writes and reads the bags')
pytest.importorskip('ray', reason="Ray runs the fleet: pip install 'rt_llm_node[fleet]'")

ROOT = Path(__file__).resolve().parents[2]
PARAMS = str(ROOT / 'config' / 'demo.yaml')


@pytest.fixture(scope='module')
def fleet_dir(tmp_path_factory):
    from rt_llm_node.demo.recorder import record_demo_bag
    root = tmp_path_factory.mktemp('fleet')
    for i, storage in enumerate(('mcap', 'sqlite3', 'mcap')):
        record_demo_bag(root / 'bags' / f'robot{i}', seconds=4.0, seed=1_000_100 + i,
                        storage=storage)
    corrupt = root / 'bags' / 'robot3'
    shutil.copytree(root / 'bags' / 'robot0', corrupt)
    mcap = next(corrupt.glob('*.mcap'))
    mcap.write_bytes(mcap.read_bytes()[:20000])
    return root


def run(*args):
    return subprocess.run([sys.executable, '-m', 'rt_llm_node.fleet', *map(str, args)],
                          capture_output=True, text=True, timeout=600)


def report(out):
    data = json.loads((Path(out) / 'report.json').read_text())
    return {b['bag']: b for b in data['bags']}, data['totals']


def decisions(folder):
    return (Path(folder) / 'actions.jsonl').read_text()


def test_a_fleet_is_reported_the_same_whatever_the_workers(fleet_dir):
    golden = fleet_dir / 'golden'
    made = run(fleet_dir / 'bags', '--params', PARAMS, '--write-golden', golden,
               '--workers', 2)
    assert made.returncode == 1, made.stderr[-2000:]   # the corrupt bag
    bags, totals = report(golden)
    assert totals['by_status'] == {'written': 3, 'error': 1}
    assert 'robot3' in bags and 'not a readable rosbag2' in bags['robot3']['error']
    assert bags['robot3']['attempts'] == 2 and bags['robot0']['attempts'] == 1
    assert 'robot3: failed (' in made.stderr and 'trying again' in made.stderr
    # a single-bag replay with the same cost model decides the same, tick for tick
    cost_model = read_cost_model(golden / 'robot0' / 'cost_model.json')
    replay(str(fleet_dir / 'bags' / 'robot0'), load_params(PARAMS), fleet_dir / 'single',
           'model', cost_model, log=lambda text: None)
    assert decisions(fleet_dir / 'single') == decisions(golden / 'robot0')
    # robot1's golden from another parameter: the wheels' command limited
    values = load_params(PARAMS)
    values['action_max'] = [180.0, 0.3, 1.5]
    shutil.rmtree(golden / 'robot1')
    replay(str(fleet_dir / 'bags' / 'robot1'), values, golden / 'robot1', 'model',
           read_cost_model(golden / 'robot0' / 'cost_model.json'), log=lambda text: None)
    runs = {}
    for workers in (1, 2):
        out = fleet_dir / f'check{workers}'
        timelines = ['--timelines'] if workers == 2 else []
        done = run(fleet_dir / 'bags', '--params', PARAMS, '--golden', golden, '--out', out,
                   '--workers', workers, *timelines)
        assert done.returncode == 1, done.stderr[-2000:]
        runs[workers] = report(out)
        assert (out / 'report.md').exists()
        # a bag's timeline.png only when asked for: the same decisions either way
        drawn = sorted(p.parent.name for p in (out / 'bags').glob('*/timeline.png'))
        assert drawn == (['robot0', 'robot1', 'robot2'] if timelines else []), drawn
    bags, totals = runs[1]
    assert totals['by_status'] == {'same': 2, 'different': 1, 'error': 1}
    assert bags['robot0']['status'] == bags['robot2']['status'] == 'same'
    first = bags['robot1']['first']
    assert first['kind'] == 'action values'
    assert first['golden']['values']['linear.x'] <= 0.3 < first['now']['values']['linear.x']
    strip = {'seconds', 'host', 'fingerprint', 'path', 'attempts'}
    for name in bags:
        assert ({k: v for k, v in runs[2][0][name].items() if k not in strip}
                == {k: v for k, v in bags[name].items() if k not in strip}), name
    # an interrupted run goes on: the finished bags are kept, the failed one tried again
    again = run(fleet_dir / 'bags', '--params', PARAMS, '--golden', golden, '--out',
                fleet_dir / 'check1', '--workers', 1, '--resume')
    assert '3 bags kept from the interrupted run' in again.stderr
    assert report(fleet_dir / 'check1')[1] == totals


def test_bad_runs_are_one_line_errors(fleet_dir, tmp_path):
    missing = run(tmp_path / 'nothing', '--params', PARAMS, '--golden', tmp_path, '--out',
                  tmp_path / 'out')
    assert missing.returncode == 2 and 'no such bag' in missing.stderr
    nowhere = run(fleet_dir / 'bags' / 'robot0', '--params', PARAMS, '--golden', tmp_path)
    assert nowhere.returncode == 2 and '--golden needs --out' in nowhere.stderr
    (tmp_path / 'foreign').mkdir()
    (tmp_path / 'foreign' / 'notes.txt').write_text('mine')
    taken = run(fleet_dir / 'bags' / 'robot0', '--params', PARAMS, '--golden', tmp_path,
                '--out', tmp_path / 'foreign')
    assert taken.returncode == 2 and 'did not write' in taken.stderr
    assert (tmp_path / 'foreign' / 'notes.txt').read_text() == 'mine'
    with __import__('socket').socket() as free:   # a port nothing listens on
        free.bind(('127.0.0.1', 0))
        port = free.getsockname()[1]
    nobody = run(fleet_dir / 'bags' / 'robot0', '--params', PARAMS, '--golden', tmp_path,
                 '--out', tmp_path / 'far', '--address', f'127.0.0.1:{port}')
    assert nobody.returncode == 2 and 'no Ray head answers there' in nobody.stderr
    from rt_llm_node.backends import cuda_available
    if not cuda_available():   # GPU shares on a cluster without a GPU: an error, not a hang
        stuck = run(fleet_dir / 'bags' / 'robot0', '--params', PARAMS, '--golden', tmp_path,
                    '--out', tmp_path / 'gpu', '--gpus-per-bag', '0.25', '--workers', 1)
        assert stuck.returncode == 2 and 'the cluster has 0' in stuck.stderr, stuck.stderr


def test_every_task_runs_the_backend_the_driver_chose():
    # a CPU task never opens the GPU its host may have: one arithmetic for the whole fleet
    assert fleet.task_backend('auto', 0.0) == 'numpy'
    assert fleet.task_backend('auto', 0.25) == 'cuda'
    assert fleet.task_backend('numpy', 0.25) == 'numpy'
    with pytest.raises(fleet.FleetError, match='--gpus-per-bag'):
        fleet.task_backend('cuda', 0.0)


def test_without_ray_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'ray', None)
    assert fleet.main(['bag', '--golden', 'g']) == 2
    assert "pip install 'rt_llm_node[fleet]'" in capsys.readouterr().err


def test_a_large_fleets_plots_show_its_worst_bags(tmp_path):
    """Up to LABELLED bags a bar each in order; beyond, the worst ones, drawn to scale."""
    from xml.etree import ElementTree
    few = [(f'b{i}', float(i % 3)) for i in range(5)]
    assert fleet.plotted(few) == (few, '5 bags')
    many = [(f'b{i:03d}', float((i * 37) % 101)) for i in range(101)]
    shown, title = fleet.plotted(many)
    assert title == f'the {fleet.LABELLED} worst of 101 bags' and len(shown) == fleet.LABELLED
    assert [v for _, v in shown] == list(range(100, 100 - fleet.LABELLED, -1))
    records = [{'bag': name, 'status': 'same', 'refusals': 6 * int(v), 'ticks': 600,
                'differences': int(v) % 7} for name, v in many]
    made = fleet._plots(tmp_path, records + [{'bag': 'bad<&>', 'status': 'error'}])
    assert made == ['refusals.svg', 'differences.svg']
    svg = '{http://www.w3.org/2000/svg}'
    for name, value in (('refusals.svg', lambda r: r['refusals'] / 6),
                        ('differences.svg', lambda r: r['differences'])):
        root = ElementTree.parse(tmp_path / name).getroot()   # well-formed XML
        bars = root.findall(f'{svg}rect[@class="bar"]')
        worst = sorted(records, key=lambda r: -value(r))[:fleet.LABELLED]
        assert [b.find(f'{svg}title').text for b in bars] == [
            f"{r['bag']}: {value(r):g}" for r in worst]
        heights = [float(b.get('height')) for b in bars]
        top = max(heights)   # to scale: each bar's height is its value's share of the tallest
        assert top > 0 and all(abs(h / top - value(r) / value(worst[0])) < 0.01
                               for h, r in zip(heights, worst))


def test_the_plots_axis_steps_are_round_and_cover_the_highest_bar():
    for top, step in ((0, 1.0), (3, 1.0), (7, 2.0), (100, 20.0), (0.4, 0.1), (12.5, 5.0)):
        assert fleet.axis_step(top) == pytest.approx(step)
        assert top / fleet.axis_step(top) <= 5
    svg = fleet.bar_chart([('a', 0.0), ('b', 0.0)], 'refused ticks (%)', 'no refusals', 'red')
    assert 'height="0.0"' in svg and 'nan' not in svg.lower()
