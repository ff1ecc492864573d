"""What generate leaves behind: PNGs and summaries with the umask (no 0600), a last line that says whether
the job finished."""

import json
import os
import stat

from PIL import Image

from prx_compile.tools.generate import _write_json, write_png


def test_pngs_and_summaries_take_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_png(Image.new("RGB", (4, 4), "red"), tmp_path / "000-a.png")
        _write_json(tmp_path / "summary.json", {"images": 1})
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "000-a.png": 0o640,
        "summary.json": 0o640,
    }  # and no temporary file left
    assert Image.open(tmp_path / "000-a.png").getpixel((0, 0)) == (255, 0, 0)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"images": 1}


def test_the_job_line_says_stopped_when_interrupted(capsys):
    from prx_compile.tools.generate import _JobBar

    bar = _JobBar(3, 0, enabled=True)  # not a terminal here: one line at the end
    bar.update(1)
    try:
        try:
            raise KeyboardInterrupt
        finally:
            bar.close()
    except KeyboardInterrupt:
        pass
    assert "1/3 images, stopped after" in capsys.readouterr().err
    bar = _JobBar(3, 0, enabled=True)
    bar.update(3)
    bar.close()
    assert "3/3 images, done in" in capsys.readouterr().err
