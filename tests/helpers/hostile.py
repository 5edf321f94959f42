"""Hostile inputs shared by the tests: a corpus of bad prompt rows and a pickle that runs code."""

from __future__ import annotations

import json

from vapo_megatron.data.prompts import MAX_ANSWER_CHARS

MAX_TOKENS = 64  # the max_prompt_tokens the corpus is written for


def j(obj) -> bytes:
    return json.dumps(obj).encode()


# (kind, the raw line of a JSONL file, skip reason, a word the logged detail must contain)
SIMPLE_BAD_ROWS = [
    ("truncated_json", b'{"prompt": "1+1=", "answer"', "invalid_json", "invalid JSON"),
    ("two_objects_on_a_line", b'{"prompt": "1", "answer": "1"} {"prompt": "2", "answer": "2"}', "invalid_json",
     "Extra data"),
    ("python_dict_quotes", b"{'prompt': '1+1=', 'answer': '2'}", "invalid_json", "invalid JSON"),
    ("nested_100k_deep", b"[" * 100_000, "invalid_json", "nested too deeply"),
    ("int_over_4300_digits", b'{"prompt": "x", "answer": ' + b"7" * 5000 + b"}", "invalid_json", "digits"),
    ("raw_ff_bytes", b'{"prompt": "\xff\xfe", "answer": "1"}', "non_utf8", "UTF-8"),
    ("latin1_text", '{"prompt": "caf\u00e9 1+1=", "answer": "2"}'.encode("latin-1"), "non_utf8", "UTF-8"),
    ("lone_surrogate_escape", b'{"prompt": "\\ud800", "answer": "1"}', "non_utf8", "'prompt'"),
    ("row_is_array", j(["1+1=", "2"]), "wrong_type", "JSON object"),
    ("row_is_string", j("1+1=2"), "wrong_type", "JSON object"),
    ("row_is_null", b"null", "wrong_type", "JSON object"),
    ("missing_prompt", j({"answer": "2"}), "missing_field", "'prompt'"),
    ("missing_answer", j({"prompt": "1+1="}), "missing_field", "'answer'"),
    ("misnamed_fields", j({"question": "1+1=", "solution": "2"}), "missing_field", "'prompt'"),
    ("prompt_is_int", j({"prompt": 11, "answer": "2"}), "wrong_type", "'prompt'"),
    ("prompt_is_chat_list", j({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}), "wrong_type",
     "'prompt'"),
    ("prompt_is_object", j({"prompt": {"text": "1+1="}, "answer": "2"}), "wrong_type", "'prompt'"),
    ("answer_is_float", j({"prompt": "1/2=", "answer": 0.5}), "wrong_type", "'answer'"),
    ("answer_is_nan", b'{"prompt": "0/0=", "answer": NaN}', "wrong_type", "'answer'"),
    ("answer_is_bool", j({"prompt": "1=1?", "answer": True}), "wrong_type", "'answer'"),
    ("answer_is_list", j({"prompt": "roots?", "answer": ["1", "2"]}), "wrong_type", "'answer'"),
    ("answer_is_null", j({"prompt": "1+1=", "answer": None}), "null_answer", "'answer' is null"),
    ("answer_is_empty", j({"prompt": "1+1=", "answer": ""}), "null_answer", "'answer' is empty"),
    ("answer_is_blank", j({"prompt": "1+1=", "answer": " \t\n"}), "null_answer", "'answer' is empty"),
    ("answer_is_huge", j({"prompt": "1+1=", "answer": "2" * (MAX_ANSWER_CHARS + 1)}), "too_long", "'answer' has"),
    ("prompt_is_empty", j({"prompt": "", "answer": "2"}), "empty_prompt", "'prompt' is empty"),
    ("prompt_is_blank", j({"prompt": "\n\t  ", "answer": "2"}), "empty_prompt", "'prompt' is empty"),
    ("prompt_over_token_limit", j({"prompt": "9" * (MAX_TOKENS + 1), "answer": "9"}), "too_long",
     "tokens > max_prompt_tokens"),
    ("prompt_of_two_megabytes", j({"prompt": "1+1=" * 500_000, "answer": "2"}), "too_long", "characters"),
]

DAPO_BAD_ROWS = [
    ("dapo_prompt_is_string", j({"prompt": "2+2?", "reward_model": {"ground_truth": "4"}}), "wrong_type",
     "'prompt' must be a list"),
    ("dapo_no_messages", j({"prompt": [], "reward_model": {"ground_truth": "4"}}), "empty_prompt", "no messages"),
    ("dapo_message_is_string", j({"prompt": ["2+2?"], "reward_model": {"ground_truth": "4"}}), "wrong_type",
     "'prompt[0]'"),
    ("dapo_message_without_content", j({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "4"}}),
     "wrong_type", "'prompt[0]'"),
    ("dapo_content_is_null", j({"prompt": [{"role": "user", "content": None}], "reward_model": {"ground_truth": "4"}}),
     "wrong_type", "'prompt[0].content'"),
    ("dapo_all_contents_blank", j({"prompt": [{"role": "user", "content": " "}],
                                   "reward_model": {"ground_truth": "4"}}), "empty_prompt", "every message"),
    ("dapo_reward_model_is_string", j({"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": "4"}),
     "wrong_type", "'reward_model'"),
    ("dapo_no_ground_truth", j({"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"style": "rule"}}),
     "missing_field", "'reward_model.ground_truth'"),
    ("dapo_ground_truth_null", j({"prompt": [{"role": "user", "content": "2+2?"}],
                                  "reward_model": {"ground_truth": None}}), "null_answer", "ground_truth' is null"),
    ("dapo_missing_reward_model", j({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}), "missing_field",
     "'reward_model'"),
]


class Payload:
    """Unpickling this calls open(marker, "w"): code execution, made visible as a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))
