"""The benchmark's table and chart as a reader sees them: CPU timings say so, fp8 records are told
apart, the chart's title fits the figure and its legend covers no bar."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from prx_compile.tools import bench  # noqa: E402


def result(gpu=None):
    env = {"torch": "2.13.0", "gpu": gpu, "cpu": "x86_64, 2 cores", "torch_tensorrt": "unavailable (no GPU)"}
    recs = []
    for path, dtype, ms in (
        ("eager", "bf16", 60.0),
        ("compile_prx", "bf16", 35.0),
        ("compile_prx", "fp8", 25.0),
    ):
        recs.append(
            {
                "path": path,
                "resolution": [1024, 1024],
                "batch": 2,
                "mask": "pipeline",
                "dtype": dtype,
                "ms_per_step": ms,
                "rel_err": 0.006,
            }
        )
    return {"env": env, "records": recs}


def test_cpu_timings_are_labelled_and_fp8_is_told_apart():
    text = bench.table(result())
    assert text.splitlines()[0].startswith("CPU timings (x86_64, 2 cores)")
    assert "compile_prx (fp8)" in text and "25.00" in text
    assert not bench.table(result(gpu="NVIDIA H200")).startswith("CPU timings")


def test_the_chart_title_fits_and_the_legend_covers_no_bar(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure it
    bench.plot(result(), tmp_path / "chart.png")
    assert (tmp_path / "chart.png").stat().st_size > 1000
    (fig,) = figures
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    page = fig.bbox
    title = ax.title.get_window_extent(renderer)
    assert page.x0 <= title.x0 and title.x1 <= page.x1, (title, page)  # not clipped on either side
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert box.y1 <= ax.get_window_extent(renderer).y0  # under the axes: it covers no bar
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["eager", "compile_prx", "compile_prx (fp8)"]
