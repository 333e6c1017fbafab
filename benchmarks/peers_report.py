"""`benchmarks.peers`' results as Markdown."""

from __future__ import annotations

from benchmarks import report

TRANSFORMERS = "transformers' generate"


def to_markdown(results: dict) -> str:
    info = results["machine"]
    lines = [
        f"# Generators vs onnxruntime-genai ({results['size']} Llama"
        f"{', ' + results['quantize'] if results.get('quantize') else ''})",
        "",
        f"{info['cpu']}, {info['cores']} cores; load average (1/5/15 min) "
        f"before timing {results['load_average_before_timing']}, at its end "
        f"{results['load_average_end_of_timing']}; "
        f"{results['busy_processes']} busy processes beside; onnxruntime-genai "
        f"{results['onnxruntime_genai']} "
        f"({results.get('onnxruntime_genai_builder', '-p fp32 -e cpu')}); "
        f"{results['request']}; "
        f"{results['rounds']} interleaved rounds, medians; reference tokens: "
        f"{results.get('reference_tokens', TRANSFORMERS)}.",
        "",
        *report.table(
            [
                ("candidate", "candidate"),
                ("tokens_per_s", "tokens/s"),
                ("vs_onnxruntime_genai", "vs onnxruntime-genai"),
                ("same_tokens_as_reference", "reference tokens"),
                ("share_of_reference_tokens", "share of reference tokens"),
                (
                    "share_of_onnxruntime_genai_tokens",
                    "share of onnxruntime-genai's tokens",
                ),
            ],
            results["rows"],
        ),
    ]
    return "\n".join(lines) + "\n"
