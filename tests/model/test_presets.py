"""The presets are data (expertmesh/model/presets.py) validated by config.preset, and the architecture config
needs nothing from the chat room: the byte vocabulary it sizes tiny and small by is expertmesh/model/byte_vocab.py."""

import subprocess
import sys

from expertmesh.chat.tokenizer import ByteTokenizer
from expertmesh.model.config import PRESET_NAMES, ModelConfig, preset
from expertmesh.model.presets import PRESETS


def test_presets_validate_fresh_each_time():
    assert PRESET_NAMES == ("tiny", "small", "full-2.8t") == tuple(PRESETS)
    for name in PRESET_NAMES:
        cfg = preset(name)
        assert isinstance(cfg, ModelConfig) and cfg.name == name and cfg == preset(name)
        assert PRESETS[name]() is not PRESETS[name]()  # builders: no shared mutable dict between callers


def test_byte_presets_match_the_byte_tokenizer():
    tok = ByteTokenizer()
    for name in ("tiny", "small"):
        cfg = preset(name)
        assert cfg.vocab_size == tok.vocab_size == 288
        v = cfg.vision
        assert (v.image_token_id, v.image_start_token_id, v.image_end_token_id) == (
            tok.image_pad_id,
            tok.image_start_id,
            tok.image_end_id,
        )


def test_config_imports_no_chat_room_and_no_torch():
    code = (
        "import sys\n"
        "from expertmesh.model.config import preset\n"
        "preset('full-2.8t').describe()\n"
        "loaded = [m for m in sys.modules if m.startswith('expertmesh.chat') or m == 'torch']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120)
