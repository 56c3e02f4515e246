"""The speed model against published speedups: every figure within the bound the docs state for it, at least
five within 15% with the one parameter set, and the docs' table is the command's output."""

from helpers import REPO
from low_bits_training.speed.published import PUBLISHED, SOURCES, comparison
from low_bits_training.speed.report import published_table


def test_every_published_figure_is_within_its_documented_bound():
    rows = comparison()
    for p, value, err in rows:
        assert abs(err) <= p.bound, f"{p.label} on {p.gpu}: predicted {value:.3f}, published {p.value}"
    assert sum(abs(err) <= 0.15 for _, _, err in rows) >= 5


def test_the_list_covers_the_issues_figures_and_names_its_sources():
    figures = {(p.source, p.gpu, p.recipe, p.value) for p in PUBLISHED}
    assert {
        ("tt-nvfp4", "B200", "mxfp8_2d_weights", 1.281),
        ("tt-nvfp4", "B200", "nvfp4", 1.370),
        ("ao-mx", "B200", "fp8_tensorwise", 1.254),
        ("ao-mx", "B200", "mxfp8", 1.200),
        ("ao-mx", "B200", "fp8_rowwise", 1.040),
        ("ao-f8", "H100", "fp8_tensorwise", 1.250),
        ("te-gemm", "B300", "mxfp8", 1.420),
        ("te-gemm", "B300", "nvfp4", 1.977),
    } <= figures
    assert {p.source for p in PUBLISHED} <= set(SOURCES)


def test_the_docs_table_is_lbt_speed_published():
    assert published_table(comparison()) in (REPO / "docs" / "speed_model.md").read_text()
