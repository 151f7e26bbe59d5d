"""Trace readers: the vendored real traces parse to their published facts; malformed input
fails naming file and line; window, time scale, clipping and spreading do what they say."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchpilot.config import REPO_ROOT
from batchpilot.envs.traces import (
    SKIP_FAILED,
    SKIP_OTHER_MODEL,
    SKIP_OUTSIDE_WINDOW,
    SKIP_TOO_LONG,
    TraceFormatError,
    TraceOptions,
    read_trace,
    spread_in_buckets,
)

AZURE = REPO_ROOT / "data/traces/azure_llm_2023_conv.csv"
MOONCAKE = REPO_ROOT / "data/traces/mooncake_synthetic.jsonl"
AZURE_CODE = REPO_ROOT / "data/traces/azure_llm_2023_code.csv"
MOONCAKE_CONV = REPO_ROOT / "data/traces/mooncake_conversation.jsonl"


@pytest.fixture(scope="module")
def azure():
    return read_trace(AZURE, "azure")


@pytest.fixture(scope="module")
def mooncake():
    return read_trace(MOONCAKE, "mooncake")


# --- the real traces ---------------------------------------------------------------------------
def test_azure_conv_matches_published_facts(azure):
    assert len(azure) == 19_366
    assert azure.report.rows_read == 19_366 and azure.report.skipped == {}
    # 18:15:46.68059 -> 19:14:08.402527 (7th fractional digit dropped by the parser: < 1 µs).
    assert azure.arrival_s[-1] == pytest.approx(58 * 60 + 21.721937, abs=1e-5)
    assert azure.arrival_s[0] == 0.0 and np.all(np.diff(azure.arrival_s) >= 0)
    assert len(azure) / azure.duration_s == pytest.approx(5.5, abs=0.1)
    assert azure.prompt_len.mean() == pytest.approx(1155, abs=1)
    assert np.median(azure.prompt_len) == 1020 and azure.prompt_len.max() == 14050
    assert azure.output_len.mean() == pytest.approx(211, abs=1)
    assert azure.output_len.max() == 1000
    assert azure.prefix_hashes is None


def test_azure_code_matches_the_facts_in_its_readme():
    code = read_trace(AZURE_CODE, "azure")
    assert len(code) == 8_819 and code.report.skipped == {}
    assert code.arrival_s[-1] == pytest.approx(3435.948, abs=1e-3)
    assert code.prompt_len.mean() == pytest.approx(2048, abs=1) and code.prompt_len.max() == 7437
    assert np.median(code.prompt_len) == 1469 and np.median(code.output_len) == 13
    assert code.output_len.mean() == pytest.approx(28, abs=1) and code.output_len.max() == 1899


def test_mooncake_conversation_matches_the_facts_in_its_readme():
    conv = read_trace(MOONCAKE_CONV, "mooncake")
    assert len(conv) == 12_031 and conv.report.skipped == {}
    assert conv.arrival_s[-1] == pytest.approx(3536.999)
    assert conv.prompt_len.mean() == pytest.approx(12_035, abs=1) and conv.prompt_len.max() == 126_195
    assert conv.output_len.mean() == pytest.approx(343, abs=1) and conv.output_len.max() == 2_000
    # Timestamps come in ~3 s buckets (1,180 distinct for 12,031 requests); spreading them
    # inside their bucket gives every request its own arrival time.
    assert len(np.unique(conv.arrival_s)) == 1_180
    spread = read_trace(MOONCAKE_CONV, "mooncake", TraceOptions(spread_quantum_s=3.0))
    assert len(np.unique(spread.arrival_s)) == 12_031
    assert all(len(h) == -(-p // 512) for h, p in zip(conv.prefix_hashes, conv.prompt_len))


def test_mooncake_matches_published_facts(mooncake):
    assert len(mooncake) == 3_993
    assert mooncake.arrival_s[-1] == pytest.approx(1022.025)
    assert mooncake.prompt_len.mean() == pytest.approx(15_325, abs=1)
    assert mooncake.prompt_len.max() == 191_378
    assert mooncake.output_len.mean() == pytest.approx(149, abs=1)
    assert mooncake.prefix_hashes is not None and len(mooncake.prefix_hashes) == 3_993
    assert mooncake.prefix_hashes[0][:3] == (0, 1, 2)
    # One 512-token block id per started block of the prompt.
    assert all(len(h) == -(-p // 512) for h, p in zip(mooncake.prefix_hashes, mooncake.prompt_len))


def test_clip_to_max_model_len_counts_and_fits(mooncake):
    tr = read_trace(MOONCAKE, "mooncake", TraceOptions(max_model_len=8192))
    total = tr.prompt_len + tr.output_len
    assert total.max() <= 8192 and tr.output_len.min() >= 1
    expected = int(((mooncake.prompt_len + mooncake.output_len) > 8192).sum())
    assert expected > 0 and tr.report.clipped == expected
    assert len(tr) == len(mooncake)
    # Prefix blocks shrink with the prompt.
    assert all(len(h) <= 16 for h in tr.prefix_hashes)


def test_skip_overflow_reports_reason(mooncake):
    tr = read_trace(MOONCAKE, "mooncake", TraceOptions(max_model_len=8192, overflow="skip"))
    n_over = int(((mooncake.prompt_len + mooncake.output_len) > 8192).sum())
    assert tr.report.skipped == {SKIP_TOO_LONG: n_over}
    assert len(tr) == len(mooncake) - n_over == tr.report.rows_kept
    assert len(tr.prefix_hashes) == len(tr)


def test_window_and_time_scale(azure):
    tr = read_trace(AZURE, "azure", TraceOptions(start_s=600, duration_s=300, time_scale=4.0))
    inside = (azure.arrival_s >= 600) & (azure.arrival_s < 900)
    assert len(tr) == int(inside.sum())
    assert tr.duration_s == pytest.approx(75.0)
    np.testing.assert_allclose(tr.arrival_s, (azure.arrival_s[inside] - 600) / 4.0)
    np.testing.assert_array_equal(tr.prompt_len, azure.prompt_len[inside])
    assert tr.report.skipped[SKIP_OUTSIDE_WINDOW] == len(azure) - len(tr)
    # Rate goes up by the time scale.
    assert len(tr) / tr.duration_s == pytest.approx(4 * inside.sum() / 300)


def test_spreading_inside_quantised_buckets(tmp_path: Path):
    p = tmp_path / "q.jsonl"
    rows = [(0, 3), (3000, 4), (9000, 1)]  # (timestamp ms, how many share it)
    with p.open("w") as f:
        for ts, n in rows:
            for _ in range(n):
                f.write(json.dumps({"timestamp": ts, "input_length": 10, "output_length": 5}) + "\n")
    plain = read_trace(p, "mooncake")
    assert list(plain.arrival_s) == [0, 0, 0, 3, 3, 3, 3, 9]
    tr = read_trace(p, "mooncake", TraceOptions(spread_quantum_s=3.0))
    np.testing.assert_allclose(tr.arrival_s, [0, 1, 2, 3, 3.75, 4.5, 5.25, 9])
    # Spreading happens in trace time, before the speed-up.
    fast = read_trace(p, "mooncake", TraceOptions(spread_quantum_s=3.0, time_scale=3.0))
    np.testing.assert_allclose(fast.arrival_s, tr.arrival_s / 3.0)


def test_spread_keeps_order_and_buckets():
    rng = np.random.default_rng(1)
    t = np.sort(np.floor(rng.uniform(0, 60, 500) / 3.0) * 3.0)
    s = spread_in_buckets(t, 3.0)
    assert np.all(np.diff(s) >= 0)
    np.testing.assert_array_equal(np.floor(s / 3.0), np.floor(t / 3.0))


def test_output_zero_raised_to_one_and_counted(tmp_path: Path):
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,100,0\n"
        "2023-11-16 18:15:47.0000000,0,7\n"
        "2023-11-16 18:15:48.1000000,5,9\n"
    )
    tr = read_trace(p, "azure")
    assert list(tr.output_len) == [1, 7, 9] and list(tr.prompt_len) == [100, 1, 5]
    assert tr.report.raised_to_one == 2
    np.testing.assert_allclose(tr.arrival_s, [0, 0.31941, 1.41941], atol=1e-6)


def test_unsorted_rows_are_sorted_and_reported(tmp_path: Path):
    p = tmp_path / "b.csv"
    p.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "10,ChatGPT,5,6,11,Conversation log\n"
        "4,ChatGPT,7,8,15,Conversation log\n"
    )
    tr = read_trace(p, "burstgpt")
    assert tr.report.resorted
    assert list(tr.arrival_s) == [0, 6] and list(tr.prompt_len) == [7, 5]


def test_burstgpt_failures_counted_not_silently_dropped(tmp_path: Path):
    p = tmp_path / "burst.csv"
    p.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "45,ChatGPT,1087,0,1087,Conversation log\n"
        "118,GPT-4,417,276,693,Conversation log\n"
        "120,ChatGPT,300,0,300,API log\n"
        "130.5,ChatGPT,20,10,30,API log\n"
    )
    tr = read_trace(p, "burstgpt")
    assert len(tr) == 3 and tr.report.rows_read == 5
    assert tr.report.skipped == {SKIP_FAILED: 2}
    assert list(tr.arrival_s) == [0, 113, 125.5]
    assert "failed (0 response tokens): 2" in tr.report.summary()
    gpt4 = read_trace(p, "burstgpt", TraceOptions(model="GPT-4"))
    assert len(gpt4) == 1 and gpt4.report.skipped == {SKIP_OTHER_MODEL: 4}
    # The time origin is the trace's first row, not the first row a filter kept.
    assert list(gpt4.arrival_s) == [113.0]
    # Model names as users type them: case aside, the same rows.
    assert list(read_trace(p, "burstgpt", TraceOptions(model="gpt-4 ")).arrival_s) == [113.0]


# --- malformed input -----------------------------------------------------------------------------
AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_OK = "2023-11-16 18:15:46.6805900,374,44\n"
BG_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
MC_OK = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'


@pytest.mark.parametrize(
    "fmt, text, line, words",
    [
        ("azure", "TIMESTAMP,ContextTokens\n" + "x,1\n", 1, "missing column"),
        ("azure", AZ_HEAD + AZ_OK + "2023-11-16 18:15:47.1,abc,3\n", 3, "ContextTokens is not a number"),
        ("azure", AZ_HEAD + AZ_OK + AZ_OK + "2023-11-16 18:15:47.1,5,-3\n", 4, "GeneratedTokens is negative"),
        ("azure", AZ_HEAD + "yesterday noon,5,3\n", 2, "not a date-time"),
        ("azure", AZ_HEAD + AZ_OK + "2023-11-16 18:15:47.1,5\n", 3, "expected 3 fields"),
        ("azure", AZ_HEAD + "2023-11-16 18:15:47.1,5.5,3\n", 2, "not a whole number"),
        ("azure", "", 1, "empty"),
        ("burstgpt", BG_HEAD + "5,ChatGPT,472,18,490,Conversation log\nnan,ChatGPT,1,2,3,x\n", 3, "not finite"),
        ("burstgpt", BG_HEAD + "soon,ChatGPT,1,2,3,x\n", 2, "Timestamp is not a number"),
        ("mooncake", MC_OK + '{"timestamp": 5, "input_length": 10\n', 2, "invalid JSON"),
        ("mooncake", MC_OK + MC_OK + '{"timestamp": 5, "output_length": 1}\n', 3, "missing field 'input_length'"),
        ("mooncake", '{"timestamp": 5, "input_length": -1, "output_length": 1}\n', 1, "input_length is negative"),
        ("mooncake", '{"timestamp": "x", "input_length": 1, "output_length": 1}\n', 1, "timestamp is not a number"),
        ("mooncake", '{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": "ab"}\n', 1, "hash_ids"),
        ("mooncake", "[1, 2]\n", 1, "expected a JSON object"),
    ],
)
def test_malformed_input_names_file_and_line(tmp_path: Path, fmt, text, line, words):
    p = tmp_path / f"bad.{fmt}"
    p.write_text(text)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p, fmt)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:{line}: "), msg
    assert words in msg
    assert ei.value.line == line and ei.value.path == str(p)
    assert isinstance(ei.value, ValueError)


def test_blank_lines_are_counted(tmp_path: Path):
    p = tmp_path / "m.jsonl"
    p.write_text(MC_OK + "\n" + MC_OK)
    tr = read_trace(p, "mooncake")
    assert len(tr) == 2 and tr.report.skipped == {"blank line": 1}


@pytest.mark.parametrize(
    "kwargs",
    [{"time_scale": 0}, {"start_s": -1}, {"duration_s": 0}, {"max_model_len": 1},
     {"overflow": "drop"}, {"spread_quantum_s": -3}],
)
def test_bad_options_rejected(kwargs):
    with pytest.raises(ValueError):
        TraceOptions(**kwargs)


def test_unknown_format_and_missing_file(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(AZURE, "sharegpt")
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        read_trace(tmp_path / "nope.csv", "azure")


# --- files as users bring them -----------------------------------------------------------------
AZURE_ROWS = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:15:{i:02d}.0000000,{100 + i},{10 + i}\n" for i in range(30)
)


def test_gzip_and_byte_order_mark_read_as_the_plain_file(tmp_path: Path):
    import gzip

    plain = tmp_path / "t.csv"
    plain.write_text(AZURE_ROWS)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + AZURE_ROWS.encode())
    packed = tmp_path / "t.csv.gz"
    packed.write_bytes(gzip.compress(AZURE_ROWS.encode()))
    unnamed = tmp_path / "no_suffix"  # told by its first bytes, not its name
    unnamed.write_bytes(gzip.compress(AZURE_ROWS.encode()))
    ref = read_trace(plain, "azure")
    for f in (bom, packed, unnamed):
        tr = read_trace(f, "azure")
        np.testing.assert_array_equal(tr.arrival_s, ref.arrival_s)
        np.testing.assert_array_equal(tr.prompt_len, ref.prompt_len)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path):
    import gzip

    bad = AZURE_ROWS.encode().replace(b"2023-11-16 18:15:07", b"2023-11-16 18:15:\xff7")
    f = tmp_path / "latin.csv"
    f.write_bytes(bad)
    with pytest.raises(TraceFormatError, match=r"latin\.csv:9: not UTF-8 text .*b'\\xff'"):
        read_trace(f, "azure")
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(gzip.compress(AZURE_ROWS.encode() * 20)[:200])
    with pytest.raises(TraceFormatError, match=r"cut\.csv\.gz:1: cannot be read as gzip"):
        read_trace(cut, "azure")


def test_mooncake_timestamps_in_seconds_are_flagged(tmp_path: Path, mooncake):
    f = tmp_path / "seconds.jsonl"
    f.write_text("".join(json.dumps({"timestamp": i * 0.5, "input_length": 100, "output_length": 10}) + "\n"
                         for i in range(40)))
    tr = read_trace(f, "mooncake")
    assert len(tr) == 40 and tr.report.warnings and "workload.time_scale=0.001" in tr.report.summary()
    # At the rate the warning suggests, nothing to flag; nor on the vendored real traces.
    assert read_trace(f, "mooncake", TraceOptions(time_scale=0.001)).report.warnings == []
    assert mooncake.report.warnings == [] and read_trace(MOONCAKE_CONV, "mooncake").report.warnings == []


def test_a_stray_timestamp_shows_as_the_longest_gap(tmp_path: Path):
    f = tmp_path / "stray.csv"
    f.write_text(AZURE_ROWS + "2024-11-16 18:15:00.0000000,100,10\n")
    rep = read_trace(f, "azure").report
    assert rep.span_s > 3e7 and rep.max_gap_s > 0.99 * rep.span_s
    assert rep.max_gap_until_s == pytest.approx(rep.span_s)
