"""The committed Python wire modules are exactly what the .proto generates."""

import pathlib

from specdec.wire import generate


def test_generated_code_is_fresh(tmp_path):
    fresh = generate.generate(tmp_path)
    committed = pathlib.Path(generate.__file__).parent
    for path in fresh:
        assert path.read_text() == (committed / path.name).read_text(), (
            f"{path.name} is stale: run `python -m specdec.wire.generate`"
        )


def test_every_field_is_documented():
    """Every message field in the .proto has a comment line above it or the message is trivial."""
    text = (generate.PROTO_ROOT / generate.PROTO_FILE).read_text().splitlines()
    undocumented = []
    in_message = False
    for i, line in enumerate(text):
        s = line.strip()
        if s.startswith("message "):
            in_message = True
            continue
        if s == "}":
            in_message = False
            continue
        if in_message and s and not s.startswith("//") and "=" in s and s.endswith(";"):
            prev = text[i - 1].strip()
            self_explaining = s.split()[-3] in ("session", "sampling", "session_id", "request_id")
            if not prev.startswith("//") and not self_explaining:
                undocumented.append(s)
    assert not undocumented, undocumented
