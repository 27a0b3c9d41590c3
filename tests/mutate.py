"""Mutation check: put each listed bug into the code, run the tests meant to catch it, report which
survive. The guarantee tests are only worth something if every mutation here is caught.

    python tests/mutate.py            # all (about 45 minutes on 2 cores)
    python tests/mutate.py --fast     # the subset CI runs (about 3 minutes)
    python tests/mutate.py --list
    python tests/mutate.py coverage_one_short inf_not_flagged

Each mutation replaces one exact snippet (which must occur once: a refactor that moves the code
makes the script fail loudly rather than test nothing) and is always reverted, even on Ctrl-C.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (file, original, mutant, tests that must fail); original/mutant may be tuples of snippets
MUTATIONS = {
    "gemma4_layers_write_into_the_capture": (
        "recipe/capture/seam.py",
        "        keep_captured(m, layers)\n",
        "",
        ["tests/test_seam.py::test_a_stack_whose_layers_write_into_their_input_keeps_what_it_captured"],
    ),
    "regeneration_decodes_without_graphs": (
        "recipe/regenerate.py",
        "        cfg.server.args.cuda_graph_backend_decode = None",
        "        pass",
        ["tests/test_sglang_backend.py::test_decode_graphs_stay_off_for_a_capture_and_go_on_for_regeneration"],
    ),
    "self_check_head_read_beside_the_capture": (
        "recipe/backends/sglang.py",
        '                    threading.Thread(target=self.check.warm, name="self-check-warm", daemon=True).start()',
        "                    pass",
        ["tests/test_sglang_backend.py::test_the_self_checks_head_is_read_while_the_server_starts"],
    ),
    "seam_leaves_flag_stacks_unflagged": (
        "recipe/capture/seam.py",
        "    if reads_flags or any(hasattr(layer, LAYER_FLAG) for layer in stack):",
        "    if any(hasattr(layer, LAYER_FLAG) for layer in stack):",
        ["tests/test_seam.py::test_every_capturing_class_gets_exactly_the_configured_ids_and_one_hooked_processor"],
    ),
    "qwen3_moe_dense_layers_served": (
        "recipe/capture/unservable.py",
        "    if dense_layers(cfg):",
        "    if False:",
        [
            "tests/test_architectures.py::test_a_qwen3_moe_with_dense_layers_is_refused_naming_them",
            "tests/test_architectures.py::test_the_recipe_refuses_an_unservable_shape_before_any_gpu_work",
        ],
    ),
    "qwen3_moe_any_head_size_served": (
        "recipe/capture/unservable.py",
        "    if head_dim(cfg) not in FUSED_ROPE_HEAD_SIZES:",
        "    if False:",
        ["tests/test_architectures.py::test_a_qwen3_moe_head_size_without_sglangs_fused_rope_kernel_is_refused"],
    ),
    "allow_list_ignored": (
        "recipe/capture/unservable.py",
        '    if name in os.environ.get(ALLOW_ENV, "").split(","):\n        return',
        "    if False:\n        return",
        ["tests/test_architectures.py::test_the_allow_list_runs_a_refused_class"],
    ),
    "multimodal_builtins_ship_no_processor": (
        "recipe/models/common.py",
        "    save_processor(family, dest)",
        "    pass",
        ["tests/test_families.py::test_each_multimodal_wrapper_ships_the_processor_files_sglang_loads"],
    ),
    "named_markers_shift_the_specials_ids": (
        "recipe/models/common.py",
        "    tok.add_special_tokens(specials)  # ids BYTES + index",
        "    pass  # ids BYTES + index",
        ["tests/test_families.py::test_each_multimodal_wrapper_ships_the_processor_files_sglang_loads"],
    ),
    "inspect_stops_at_a_missing_shard": (
        "recipe/shards/summary.py",
        '    except (CorruptRecord, OSError):\n        return f"(unreadable',
        '    except ():\n        return f"(unreadable',
        ["tests/test_failures.py::test_inspect_still_summarizes_a_set_whose_shard_is_gone"],
    ),
    "dflash_spread_in_their_numbering": (
        "recipe/capture/presets.py",
        "(k - 1))) + 1 for i in range(k)]",
        "(k - 1))) for i in range(k)]",
        ["tests/test_presets.py::test_the_spread_is_dflashs_own_choice_plus_one"],
    ),
    "preset_overrides_the_users_layers": (
        "recipe/capture/presets.py",
        "    if list(cfg.capture.layers):",
        "    if False:",
        ["tests/test_presets.py::test_a_preset_is_refused_in_one_line_where_it_cannot_be_taken"],
    ),
    "preset_takes_a_shallow_models_repeats": (
        "recipe/capture/presets.py",
        "    if len(set(layers)) < k or num_layers < 4:",
        "    if False:",
        ["tests/test_presets.py::test_a_preset_is_refused_in_one_line_where_it_cannot_be_taken"],
    ),
    "hf_misses_a_wrapped_language_model": (
        "recipe/backends/hf.py",
        'LANGUAGE_MODEL = {r"^model\\.language_model\\.": "model.", ',
        "LANGUAGE_MODEL = {",
        [
            "tests/test_families.py::test_each_family_runs_end_to_end_and_each_slot_is_nearest_its_hf_index[tiny-gemma-4]"
        ],
    ),
    "hf_takes_a_text_model_transformers_has_no_class_for": (
        "recipe/backends/hf.py",
        "    if not has_causal_lm(text):",
        "    if False:",
        [
            "tests/test_families.py::test_each_family_runs_end_to_end_and_each_slot_is_nearest_its_hf_index[tiny-qwen3-vl]"
        ],
    ),
    "self_check_judges_an_fp8_set_by_bf16s_bound": (
        "recipe/selfcheck.py",
        '                fp8 = (store.identity or {}).get("codec") == codec_fp8.NAME',
        "                fp8 = False",
        ["tests/test_sglang_backend.py::test_the_self_check_allows_an_fp8_set_its_rounding_and_a_lossless_one_bf16s"],
    ),
    "self_check_allows_fp8_no_rounding": (
        "recipe/selfcheck.py",
        "    return lp, bound(peak) + SIGMAS * sigma, sigma",
        "    return lp, bound(peak), sigma",
        ["tests/test_selfcheck.py::test_an_fp8_final_slot_passes_though_its_rounding_moves_logprobs_past_bf16s_bound"],
    ),
    "self_check_fp8_allows_anything": (
        "recipe/selfcheck.py",
        "    return lp, bound(peak) + SIGMAS * sigma, sigma",
        "    return lp, bound(peak) + 50 * SIGMAS * sigma, sigma",
        ["tests/test_selfcheck.py::test_an_fp8_final_slot_one_layer_early_is_still_refused"],
    ),
    "self_check_judges_on_every_core": (
        "recipe/selfcheck.py",
        "    torch.set_num_threads(min(n, before) if n > 0 else before)",
        "    torch.set_num_threads(before)",
        [
            "tests/test_selfcheck.py::test_the_self_check_reads_and_judges_on_the_cores_it_is_given_then_leaves_the_count_as_it_was"
        ],
    ),
    "self_check_judges_an_fp8_slot_its_rounding_hides": (
        "recipe/selfcheck.py",
        "            if not v.judged:",
        "            if False:",
        [
            "tests/test_selfcheck.py::test_an_fp8_set_whose_rounding_alone_moves_logprobs_that_far_is_refused_naming_lossless"
        ],
    ),
    "draft_bench_fp8_call_keeps_the_spread_fp8_cannot_hold": (
        "bench/draft/scenario.py",
        "        a.norm_spread = 1.0 if a.fp8 else 3.0",
        "        a.norm_spread = 3.0",
        ["tests/test_draft_bench.py::test_an_fp8_call_trains_a_target_whose_final_state_fp8_can_hold"],
    ),
    "draft_bench_fp8_final_arm_quantizes_the_last_aux_slot": (
        "bench/draft/fp8slots.py",
        '"hidden": fp8_roundtrip(x["hidden"], [n_aux])}',
        '"hidden": fp8_roundtrip(x["hidden"], [n_aux - 1])}',
        [
            "tests/test_draft_bench.py::"
            "test_the_fp8_slot_arms_read_the_fp8_sets_values_in_their_slots_and_the_lossless_ones_elsewhere"
        ],
    ),
    "draft_bench_fp8_sizes_measure_the_error_in_l1": (
        "bench/draft/fp8slots.py",
        "(q - x).square().sum((0, 2)), x.square().sum((0, 2))",
        "(q - x).abs().sum((0, 2)), x.abs().sum((0, 2))",
        [
            "tests/test_draft_bench.py::"
            "test_the_fp8_slot_arms_read_the_fp8_sets_values_in_their_slots_and_the_lossless_ones_elsewhere"
        ],
    ),
    "packer_tail_never_marks_the_hand_over_to_a_worker": (
        "recipe/packer/scheduler.py",
        '        self.progress.mark("dispatched")\n',
        "",
        ["tests/test_pipeline.py::test_bad_input_is_accounted_and_the_run_goes_on"],
    ),
    "preflight_counts_fp8_at_losslesss_ratio": (
        "recipe/preflight.py",
        '    if codec == "fp8":\n        return raw,',
        "    if False:\n        return raw,",
        ["tests/test_fp8.py::test_the_disk_check_counts_on_what_fp8_records_hold_and_passes_a_run_that_fits"],
    ),
    "draft_bench_later_call_forgets_the_earlier_arms": (
        "bench/draft/scenario.py",
        "                res[name] = kept(res.get(name), step(), name, a.work)\n",
        "                res[name] = step()\n",
        ["tests/test_draft_bench.py::test_a_later_call_on_other_arms_keeps_what_the_earlier_call_trained_and_served"],
    ),
    "draft_bench_keeps_arms_whose_drafts_are_gone": (
        "bench/draft/scenario.py",
        'for arm, v in before[key].items() if (work / "drafts" / f"{arm}-curve.json").exists()}',
        "for arm, v in before[key].items()}",
        ["tests/test_draft_bench.py::test_a_later_call_on_other_arms_keeps_what_the_earlier_call_trained_and_served"],
    ),
    "draft_bench_resumes_a_work_folder_made_with_other_options": (
        "bench/draft/scenario.py",
        "    if diff:\n        was =",
        "    if False:\n        was =",
        ["tests/test_draft_bench.py::test_a_call_on_a_work_folder_made_with_other_options_stops_in_one_line"],
    ),
    "draft_bench_out_of_memory_arm_stops_the_call": (
        "bench/draft/train.py",
        '        if out_of_memory(work / "drafts" / f"{arm}.log"):',
        "        if False:",
        ["tests/test_draft_bench.py::test_an_arm_out_of_gpu_memory_beside_the_others_trains_again_once_one_ends"],
    ),
    "draft_bench_out_of_memory_arm_never_trains_again": (
        "bench/draft/waves.py",
        "            for _ in range(max(ended, 0 if running else 1)):",
        "            for _ in range(0):",
        ["tests/test_draft_bench.py::test_an_arm_out_of_gpu_memory_beside_the_others_trains_again_once_one_ends"],
    ),
    "draft_bench_controls_read_their_prompts_in_threads": (
        "bench/draft/serve.py",
        "            eval_prompts(w)  # importing",
        "            pass  # importing",
        ["tests/test_draft_bench.py::test_the_controls_held_out_prompts_are_read_in_the_main_thread"],
    ),
    "regenerate_probes_the_turn_end_with_whitespace": (
        "recipe/data.py",
        '    probe = "\\ue000"',
        '    probe = "\\x1f"',
        [
            "tests/test_regenerate.py::test_regeneration_stops_at_the_token_each_built_in_template_ends_a_turn_with",
            "tests/test_draft_bench.py::test_the_bpe_target_regenerates_its_answers_through_its_llama3_template",
        ],
    ),
    "regenerate_trains_the_prompt_too": (
        "recipe/regenerate.py",
        "ids, mask = ids + piece, mask + [0] * len(piece)",
        "ids, mask = ids + piece, mask + [1] * len(piece)",
        [
            "tests/test_regenerate.py::test_stored_ids_are_the_prompts_ids_then_the_generated_ids_and_only_those_are_trained"
        ],
    ),
    "regenerate_stores_its_text_retokenized": (
        "recipe/regenerate.py",
        'ids, mask = ids + turn["generated"], ',
        'ids, mask = ids + self.tokenizer.encode(self.tokenizer.decode(turn["generated"]), add_special_tokens=False), ',
        [
            "tests/test_regenerate.py::test_stored_ids_are_the_prompts_ids_then_the_generated_ids_and_only_those_are_trained"
        ],
    ),
    "regenerate_forgets_its_file_on_a_resume": (
        "recipe/regenerate.py",
        "turn = self.journal.turns.get((s.id, k))",
        "turn = None",
        ["tests/test_regenerate.py::test_a_resume_after_a_kill_between_regeneration_and_capture_writes_no_turn_again"],
    ),
    "regenerate_trips_on_a_torn_line": (
        "recipe/regenerate.py",
        'whole = data[: data.rfind(b"\\n") + 1]',
        "whole = data",
        ["tests/test_regenerate.py::test_a_torn_last_line_is_written_again_and_the_file_goes_on_whole"],
    ),
    "regenerate_leaves_the_identity": (
        "recipe/provenance.py",
        'if cfg.data.regenerate.turns != "off" else {}',
        "if False else {}",
        ["tests/test_regenerate.py::test_regenerated_and_original_answers_never_share_a_set"],
    ),
    "regenerate_keeps_a_cut_turn_it_should_skip": (
        "recipe/regenerate.py",
        'if self.data_cfg.regenerate.cut == "skip":',
        "if False:",
        ["tests/test_regenerate.py::test_a_turn_cut_at_max_new_tokens_is_kept_as_cut_or_its_record_skipped"],
    ),
    "regenerate_stops_after_the_first_turn": (
        "recipe/regenerate.py",
        "  # up to its end-of-turn\n",
        "  # up to its end-of-turn\n            break\n",
        ["tests/test_regenerate.py::test_all_turns_are_written_turn_by_turn_each_prompt_the_stored_ids_so_far"],
    ),
    "regenerate_launches_the_server_from_a_pool_thread": (
        "recipe/regenerate.py",
        "            backend.up()  # thread",
        "            pass  # thread",
        [
            "tests/test_regenerate.py::test_through_the_server_the_answers_are_the_servers_ids_and_no_generation_pass_is_dumped"
        ],
    ),
    "regenerate_skips_a_prompt_without_an_answer": (
        "recipe/data.py",
        "    if not answered and not answers_optional:",
        "    if not answered:",
        ["tests/test_regenerate.py::test_records_of_prompts_alone_get_the_targets_answer"],
    ),
    "regenerate_answers_no_trailing_prompt": (
        "recipe/regenerate.py",
        '        msgs.append({"role": "assistant", "content": ""})',
        "        pass",
        ["tests/test_regenerate.py::test_records_of_prompts_alone_get_the_targets_answer"],
    ),
    "scan_trusts_a_raw_low_plane": (
        "recipe/shards/framing.py",
        "    check_tail(frame, record_header(frame))",
        "    pass",
        ["tests/test_edges.py::test_with_the_index_lost_a_record_damaged_in_its_low_plane_is_never_indexed_as_whole"],
    ),
    "writer_checks_no_low_plane": (
        "recipe/shards/codec.py",
        "            self.tail_crc = crc32(b, self.tail_crc)\n",
        "",
        ["tests/test_roundtrip.py::test_record_layout_is_the_documented_one_and_v1_records_still_read"],
    ),
    "a_cut_check_frame_is_not_torn": (
        "recipe/shards/framing.py",
        "    return len(rest) < trailer(header) and CHECK_MAGIC.startswith(rest[:8])",
        "    return False",
        ["tests/test_guarantees.py::test_a_record_cut_inside_its_check_frame_is_torn_and_cut"],
    ),
    "a_check_frame_past_the_shard_end_is_whole": (
        "recipe/shards/framing.py",
        " or at + a + b + k > len(buf)):",
        "):",
        ["tests/test_guarantees.py::test_a_record_cut_inside_its_check_frame_is_torn_and_cut"],
    ),
    "regenerate_writes_through_a_link": (
        "recipe/regenerate.py",
        "        if self.path.is_symlink():  # appending",
        "        if False:  # appending",
        ["tests/test_regenerate.py::test_a_link_in_place_of_the_file_is_refused_and_its_target_untouched"],
    ),
    "sglang_runs_an_architecture_it_cannot_dump": (
        "recipe/main.py",
        'if cfg.backend.name == "sglang":  # a class',
        'if cfg.backend.name == "none":  # a class',
        ["tests/test_architectures.py::test_the_recipe_refuses_it_before_tokenizing_or_writing"],
    ),
    "architectures_accept_any_class": (
        "recipe/capture/architectures.py",
        "if name not in DUMPED:",
        "if name in DUMPED and False:",
        ["tests/test_architectures.py::test_an_architecture_without_dumps_is_refused_in_one_line_naming_it"],
    ),
    "architectures_list_a_class_that_cannot_capture": (
        "recipe/capture/architectures.py",
        '"TeleFLMForCausalLM",',
        '"TeleFLMForCausalLM",\n        "MixtralForCausalLM",',
        ["tests/test_architectures.py::test_the_accepted_architectures_are_the_pinned_wheels_capturing_classes"],
    ),
    "seam_keeps_the_classes_own_ids": (
        "recipe/capture/seam.py",
        "        set_ids(m, layers)\n",
        "        pass\n",
        ["tests/test_seam.py::test_every_capturing_class_gets_exactly_the_configured_ids_and_one_hooked_processor"],
    ),
    "seam_hooks_the_outer_processor": (
        "recipe/capture/seam.py",
        'procs = [m.logits_processor for m in owners if hasattr(m, "logits_processor")]',
        'procs = [model.logits_processor] if hasattr(model, "logits_processor") else []',
        ["tests/test_seam.py::test_a_wrappers_idle_processor_gets_no_hook"],
    ),
    "seam_leaves_capture_on_for_the_final_state_alone": (
        "recipe/capture/seam.py",
        "            setattr(m, CAPTURE_FLAG, False)",
        "            pass",
        ["tests/test_seam.py::test_the_final_state_alone_leaves_capture_off"],
    ),
    "self_check_passes_any_slot": (
        "recipe/selfcheck.py",
        "return self.off <= OUTLIERS * self.checked",
        "return True",
        ["tests/test_sglang_backend.py::test_a_wrong_final_slot_refuses_the_run_naming_the_slot"],
    ),
    "self_check_asks_for_a_decoded_token": (
        "recipe/backends/sglang.py",
        '"sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}',
        '"sampling_params": {"max_new_tokens": int(ask), "temperature": 0.0}}',
        ["tests/test_sglang_backend.py::test_the_self_checks_requests_are_prefill_only_and_go_out_with_the_rest"],
    ),
    "self_check_stops_watching_before_its_answers": (
        "recipe/selfcheck.py",
        "while len(check.verdicts) < check.samples and check.skipped is None:",
        "while check.pending() or check.requested < check.samples:",
        ["tests/test_selfcheck.py::test_the_watcher_keeps_watching_while_its_requests_are_out_unanswered"],
    ),
    "draft_bench_other_data_arm_gets_the_sets_mapping": (
        "bench/draft/train.py",
        'vocab[kind if kind in OWN_MAPS else "real"]',
        'vocab["real"]',
        ["tests/test_draft_bench.py::test_each_arm_gets_its_shards_draft_config_and_vocabulary_mapping"],
    ),
    "draft_bench_shuffled_mapping_keeps_the_sets_ids": (
        "bench/draft/vocab.py",
        "perm = np.random.default_rng(seed).permutation(target)",
        "perm = np.arange(target)",
        ["tests/test_draft_bench.py::test_each_arm_gets_its_shards_draft_config_and_vocabulary_mapping"],
    ),
    "draft_bench_original_answers_get_the_regenerated_sets_mapping": (
        "bench/draft/vocab.py",
        'OWN_MAPS = ("other_data", "shuffled", "original")',
        'OWN_MAPS = ("other_data", "shuffled")',
        ["tests/test_draft_bench.py::test_a_regen_call_trains_drafts_on_the_targets_answers_and_on_the_original_ones"],
    ),
    "draft_bench_trains_an_arm_whose_set_was_not_captured": (
        "bench/draft/train.py",
        "    if missing:\n        raise SystemExit",
        "    if missing and False:\n        raise SystemExit",
        ["tests/test_draft_bench.py::test_a_call_that_trains_an_arm_without_its_set_stops_in_one_line"],
    ),
    "draft_bench_captures_the_off_by_one_set_for_every_call": (
        "bench/draft/extract.py",
        'if "off_by_one" in arms else {}',
        "if True else {}",
        ["tests/test_draft_bench.py::test_the_extractions_capture_the_default_layers_of_the_target_on_disk"],
    ),
    "draft_bench_resumed_call_skips_the_sets_its_arms_need": (
        "bench/draft/scenario.py",
        'return any(not (work / "shards" / n / "manifest.json").exists() for n in runs)',
        "return False",
        ["tests/test_draft_bench.py::test_a_resumed_call_naming_new_arms_captures_and_trains_what_they_need"],
    ),
    "draft_bench_target_trains_on_other_ids_than_extracted": (
        "bench/draft/chat.py",
        "return self.encode([self.text(u.decode(), r.decode()) for u, r in pairs])",
        "return [self.prompt(u) + self.encode([r.decode()])[0] + [self.eot] for u, r in pairs]",
        ["tests/test_draft_bench.py::test_the_bpe_targets_conversations_are_the_ids_the_recipe_extracts"],
    ),
    "draft_bench_target_keeps_its_weights_on_the_gpu": (
        "bench/draft/target.py",
        "    del model, loss_of, evals\n",
        "",
        ["tests/test_draft_bench.py::test_the_target_step_leaves_the_gpu_to_the_trainers_that_follow"],
    ),
    "draft_bench_regen_arm_captures_the_original_answers": (
        "bench/draft/extract.py",
        'return {"real": (layers, REGEN), "original": (layers, ())}',
        'return {"real": (layers, ()), "original": (layers, ())}',
        ["tests/test_draft_bench.py::test_a_regen_call_trains_drafts_on_the_targets_answers_and_on_the_original_ones"],
    ),
    "regeneration_sends_the_captures_concurrency": (
        "recipe/regenerate.py",
        'workers = self.data_cfg.regenerate.concurrency if getattr(backend, "batches_generation", False) else 1',
        "workers = getattr(backend, 'client').concurrency if hasattr(backend, 'client') else 1",
        ["tests/test_regenerate.py::test_a_server_is_sent_data_regenerate_concurrency_turns_at_once"],
    ),
    "run_log_takes_a_line_per_request": (
        "recipe/backends/sglang.py",
        'logging.getLogger("httpx").setLevel(logging.WARNING)',
        'logging.getLogger("httpx").setLevel(logging.INFO)',
        ["tests/test_sglang_backend.py::test_the_run_log_holds_its_progress_not_a_line_per_request"],
    ),
    "self_check_names_the_shift_backwards": (
        "recipe/selfcheck.py",
        "{'before' if v.shifted > 0 else 'after'}",
        "{'before' if v.shifted < 0 else 'after'}",
        ["tests/test_sglang_backend.py::test_a_wrong_final_slot_refuses_the_run_naming_the_slot"],
    ),
    "draft_trains_toward_a_post_norm_teacher": (
        "recipe/shards/trainers.py",
        'speculators_raw(x, self.n_aux, "pre-norm-equivalent", self.norm_weight)',
        'speculators_raw(x, self.n_aux, "keep-post-norm", self.norm_weight)',
        ["tests/test_draft_cpu.py::test_a_draft_from_the_shards_agrees_with_the_target_better_than_one_a_layer_off"],
    ),
    "draft_trains_on_reversed_slots": (
        "recipe/shards/trainers.py",
        '"hidden_states": hs[:, :-1].flatten(1),',
        '"hidden_states": hs[:, :-1].flip(1).flatten(1),',
        ["tests/test_draft_cpu.py::test_a_draft_from_the_shards_agrees_with_the_target_better_than_one_a_layer_off"],
    ),
    "quick_exit_skips_exit_handlers": (
        "recipe/procs.py",
        "    atexit._run_exitfuncs()  # what a normal exit runs before the teardown\n",
        "",
        ["tests/test_cli_errors.py::test_the_exit_that_skips_teardown_keeps_status_output_threads_and_exit_handlers"],
    ),
    "quick_exit_leaves_threads_running": (
        "recipe/procs.py",
        "            t.join()\n",
        "            pass\n",
        ["tests/test_cli_errors.py::test_the_exit_that_skips_teardown_keeps_status_output_threads_and_exit_handlers"],
    ),
    "export_chunks_out_of_order": (
        "recipe/shards/export.py",
        "            rows += part.rows\n",
        "            rows = part.rows + rows\n",
        ["tests/test_export.py::test_an_export_spread_over_processes_writes_what_one_process_writes"],
    ),
    "export_worker_on_a_thread_per_core": (
        "recipe/shards/export.py",
        "    torch.set_num_threads(1)\n",
        "",
        ["tests/test_export.py::test_an_export_worker_runs_one_torch_thread"],
    ),
    "draft_training_argv_through_argparse": (
        "bench/draft/scenario.py",
        'if argv[:1] == ["_sftrain"]:',
        'if argv[:1] == ["_sftrain"] and "--to" not in argv:',
        ["tests/test_draft_bench.py"],
    ),
    "draft_captures_the_default_depths_layers": (
        "bench/draft/extract.py",
        'layers = eagle3_layers(json.loads((work / "target" / "config.json").read_text())["num_hidden_layers"])',
        "layers = eagle3_layers(16)",
        ["tests/test_draft_bench.py"],
    ),
    "server_wait_note_without_its_log_line": (
        "recipe/backends/sglang.py",
        'self.last_log_line() or "(nothing yet)"',
        '"(nothing yet)"',
        ["tests/test_sglang_backend.py::test_a_slow_start_is_reported_with_the_servers_latest_line"],
    ),
    "server_wait_note_with_the_first_line": (
        "recipe/backends/sglang.py",
        'return lines[-1][:limit] if lines else ""',
        'return lines[0][:limit] if lines else ""',
        ["tests/test_sglang_backend.py::test_a_slow_start_is_reported_with_the_servers_latest_line"],
    ),
    "server_wait_note_shows_its_own_health_polls": (
        "recipe/backends/sglang.py",
        """if x.strip() and '"GET /health' not in x]""",
        "if x.strip()]",
        ["tests/test_sglang_backend.py::test_a_slow_start_is_reported_with_the_servers_latest_line"],
    ),
    "server_log_tail_keeps_a_cut_line": (
        "recipe/backends/sglang.py",
        "return lines[1:] if start else lines",
        "return lines",
        ["tests/test_sglang_backend.py::test_the_servers_log_tail_never_starts_with_a_cut_line"],
    ),
    "server_wait_note_reads_a_few_polls_back": (
        "recipe/backends/sglang.py",
        "for x in self.log_lines() or ()",
        "for x in self.log_lines(8192) or ()",
        ["tests/test_sglang_backend.py::test_a_start_of_many_minutes_still_shows_the_line_before_its_polls"],
    ),
    "one_zstd_context_for_every_thread": (
        "recipe/shards/codec.py",
        "_local = threading.local()",
        "_local = threading",
        [
            "tests/test_roundtrip.py::test_each_thread_decodes_with_its_own_zstd_context",
            "tests/test_roundtrip.py::test_threads_sharing_one_reader_get_their_own_samples",
        ],
    ),
    "bf16_band_passes_a_sample_with_one_slot_inside": (
        "bench/peers.py",
        'sum(all(e <= b for e, b in zip(p["rel_l2"], band)) for p in per)',
        'sum(any(e <= b for e, b in zip(p["rel_l2"], band)) for p in per)',
        ["tests/test_peers.py::test_the_bf16_band_holds_a_bf16_copy_and_not_a_state_moved_past_it"],
    ),
    "peer_seed_repeats_the_real_draft": (
        "bench/draft_peer.py",
        'for s, arm in enumerate(sets["ours"][1:], start=1):',
        'for s, arm in enumerate(sets["ours"][1:], start=0):',
        ["tests/test_draft_peer.py::test_each_set_trains_its_seeds_from_its_own_files"],
    ),
    "peer_verdict_passes_a_set_far_below": (
        "bench/draft_peer.py",
        '"within_noise": abs(diff) <= 2 * se}',
        '"within_noise": diff <= 2 * se}',
        [
            "tests/test_draft_peer.py::test_the_verdict_weighs_the_difference_of_the_sets_against_the_spread_of_their_seeds"
        ],
    ),
    "band_against_passes_one_slot_past": (
        "bench/peers.py",
        '"every_sample_within_band": all(w <= b for w, b in zip(worst, band))}',
        '"every_sample_within_band": any(w <= b for w, b in zip(worst, band))}',
        [
            "tests/test_peers.py::test_a_band_rebuilt_for_an_earlier_run_tokenizes_as_the_recipe_and_holds_its_worst_slot"
        ],
    ),
    "same_data_passes_a_mask_one_bit_off": (
        "bench/peers.py",
        '"loss_mask_equal": sum(p["loss_mask_diff_count"] == 0 for p in per),',
        '"loss_mask_equal": sum(p["loss_mask_diff_count"] <= 1 for p in per),',
        [
            "tests/test_draft_peer.py::test_specforge_reads_the_conversations_as_our_shards_ids_and_masks_and_a_change_is_seen",
            "tests/test_peers.py::test_same_data_check_cuts_batch_padding_and_sees_each_difference",
        ],
    ),
    "index_line_read_up_to_its_first_record": (
        "recipe/shards/store.py",
        "        if end == len(line):\n",
        "        if True:\n",
        ["tests/test_integrity.py::test_an_index_line_is_json_exactly_as_json_reads_it"],
    ),
    "stepwise_join_off_by_a_block": (
        "recipe/shards/codec.py",
        "b0, b1 = a // RAW_BLOCK, min(full.shape[0], (a + k) // RAW_BLOCK)",
        "b0, b1 = a // RAW_BLOCK, min(full.shape[0], (a + k) // RAW_BLOCK + 1)",
        ["tests/test_roundtrip.py::test_a_record_decoded_in_steps_is_the_stored_record_and_lets_its_pages_go"],
    ),
    "stepwise_keeps_frame_b_pages": (
        "recipe/shards/codec.py",
        "            release(b_start + 13 + b0 * (RAW_BLOCK + 3), b_start + 13 + b1 * (RAW_BLOCK + 3))\n",
        "",
        ["tests/test_roundtrip.py::test_a_record_decoded_in_steps_is_the_stored_record_and_lets_its_pages_go"],
    ),
    "reader_never_decodes_in_steps": (
        "recipe/shards/reader.py",
        '        if rec["length"] < STEPWISE_FROM or not hasattr(mmap, "MADV_DONTNEED"):',
        "        if True:",
        ["tests/test_roundtrip.py::test_the_reader_reads_a_long_record_in_steps_as_it_reads_a_short_one"],
    ),
    "packer_full_disk_raised_as_a_bug": (
        "recipe/packer/scheduler.py",
        "    if full is not None:  # a worker's frame",
        "    if False:  # a worker's frame",
        ["tests/test_reliability.py::test_output_disk_full_stops_cleanly_and_resumes"],
    ),
    "export_full_disk_as_a_traceback": (
        "recipe/shards/__main__.py",
        "    if full is not None:  # export and merge write gigabytes",
        "    if False:  # export and merge write gigabytes",
        ["tests/test_export.py::test_a_full_disk_during_export_is_one_line_and_names_it"],
    ),
    "a_full_ram_disk_blamed_on_the_output": (
        "recipe/main.py",
        "Path(str(err.filename)).resolve().is_relative_to(Path(cfg.capture.dump_dir).resolve()):",
        "False:",
        ["tests/test_reliability.py::test_a_full_ram_disk_is_named_as_the_dump_folder_not_the_output_disk"],
    ),
    "hf_batch_ignores_the_dump_budget": (
        "recipe/backends/hf.py",
        "        if budget_bytes:\n",
        "        if False:\n",
        ["tests/test_reliability.py::test_the_hf_backend_keeps_each_batch_within_the_dump_budget"],
    ),
    "resume_loads_the_model": (
        "recipe/main.py",
        "    if not job.todo:\n        return None\n",
        "",
        ["tests/test_pipeline.py::test_a_resume_with_nothing_to_do_loads_no_model"],
    ),
    "piece_rows_restart_at_zero": (
        "recipe/packer/worker.py",
        "yield row + r, block.reshape(k, slots, hidden)",
        "yield r, block.reshape(k, slots, hidden)",
        ["tests/test_guarantees.py::test_a_bad_value_in_any_piece_of_a_chunked_sample_is_refused"],
    ),
    "forward_error_not_counted": (
        "recipe/backends/hf.py",
        'sink.fail(rid, f"forward_error: {type(e).__name__}: {e}")',
        "pass",
        ["tests/test_pipeline.py::test_a_batch_whose_forward_fails_is_counted_and_the_run_fails"],
    ),
    "long_text_tokenized_whole": (  # one huge message tokenized in full: minutes and gigabytes to plan
        "recipe/data.py",
        "short, cut = cut_messages(msgs, int((data_cfg.max_length + CUT_MARGIN) * CHARS_PER_TOKEN_BOUND))",
        "short, cut = msgs, False",
        ["tests/test_data.py::test_a_huge_message_is_cut_before_tokenizing_and_keeps_the_whole_texts_first_tokens"],
    ),
    "cut_trusted_without_proof": (  # text with long tokens: the cut changes the first max_length tokens
        "recipe/data.py",
        "if cut and len(ids) <= data_cfg.max_length + CUT_MARGIN:",
        "if False:",
        ["tests/test_data.py::test_text_whose_tokens_are_longer_than_the_cut_assumes_is_tokenized_whole"],
    ),
    "yaml_default_drifts": (  # a group's YAML says one default, the schema (and every other entry point) another
        "conf/shards/default.yaml",
        "{}\n",
        "workers: 2\n",
        ["tests/test_config.py::test_a_default_group_sets_no_default_the_schema_holds"],
    ),
    "slot_count_unchecked": (
        "recipe/packer/checks.py",
        "    if slots != n_slots:\n",
        "    if False:\n",
        ["tests/test_guarantees.py::test_a_dump_with_another_slot_count_is_refused_not_stored"],
    ),
    "verify_ranges_drop_the_last": (
        "recipe/shards/verify.py",
        "return out + ([(lo, len(records))] if lo < len(records) else [])",
        "return out",
        ["tests/test_integrity.py::test_verify_over_several_processes_names_what_one_process_names"],
    ),
    "verify_workers_skip_their_first_record": (
        "recipe/shards/verify.py",
        "for rec in recs:",
        "for rec in recs[(r is _WORKER_READER) :]:",
        ["tests/test_integrity.py::test_verify_over_several_processes_names_what_one_process_names"],
    ),
    "verify_keeps_every_shards_pages": (
        "recipe/shards/verify.py",
        "        r.let_go(shard)\n",
        "        pass\n",
        ["tests/test_integrity.py::test_verify_lets_go_of_the_pages_of_every_shard_it_has_read"],
    ),
    "verify_progress_counts_ranges": (
        "recipe/shards/verify.py",
        "self.samples + part.samples",
        "self.samples + 1",
        ["tests/test_integrity.py::test_a_long_verify_says_how_far_it_is_with_its_rate_and_eta"],
    ),
    "verify_ignores_the_mask_length": (
        "recipe/shards/verify.py",
        'or shapes["loss_mask"][0] != rec["tokens"]',
        "",
        ["tests/test_guarantees.py::test_verify_names_a_loss_mask_whose_length_is_not_the_token_count"],
    ),
    "merge_ignores_template_kwargs": (
        "recipe/shards/merge.py",
        'SPLIT_KEYS = ("sources", "split", "shard_index", "num_shards", "limit")',
        'SPLIT_KEYS = ("sources", "split", "shard_index", "num_shards", "limit", "chat_template_kwargs", "overflow")',
        ["tests/test_integrity.py::test_merge_refuses_sets_whose_samples_differ_as_resume_would"],
    ),
    "damaged_builtin_cache_reused": (
        "recipe/models/__init__.py",
        'if (dest / "config.json").exists() and intact(dest):',
        'if (dest / "config.json").exists():',
        ["tests/test_pipeline.py::test_a_damaged_builtin_model_cache_is_rebuilt"],
    ),
    "resume_cuts_what_it_cannot_prove": (
        "recipe/shards/repair.py",
        "    if framing.torn(w.m, at):\n        return at, None\n",
        "    if True:\n        return at, None\n",
        [
            "tests/test_integrity.py::test_a_resume_never_appends_to_a_shard_whose_tail_it_left_alone",
            "tests/test_ownership.py::test_verify_says_what_garbage_after_a_shard_is_and_the_resume_leaves_it",
        ],
    ),
    "resume_indexes_a_damaged_copy": (
        "recipe/shards/repair.py",
        """            if rid in named and line["crc32"] not in named[rid]:\n""",
        "            if False:\n",
        [
            "tests/test_integrity.py::test_a_flipped_byte_is_found_by_a_deep_resume_and_redone",
            "tests/test_integrity.py::test_an_index_line_whose_crc32_was_edited_never_vouches_for_its_record",
        ],
    ),
    "resume_cuts_whole_records_the_index_lost": (
        "recipe/shards/repair.py",
        "            kept.append(line)\n            ids.add(rid)\n",
        "            continue\n",
        ["tests/test_ownership.py::test_a_lost_index_is_rebuilt_from_the_shards_before_any_resume_decision"],
    ),
    "export_over_its_own_set": (
        "recipe/shards/export.py",
        "    refuse_alias(out, [r.root], ExportError)\n",
        "",
        ["tests/test_ownership.py::test_an_export_never_writes_over_its_own_set"],
    ),
    "merge_replaces_a_file_in_its_output": (
        "recipe/shards/merge.py",
        "    if dst.exists() or dst.is_symlink():\n",
        "    if False:\n",
        ["tests/test_ownership.py::test_a_merge_again_into_an_interrupted_merge_never_writes_into_its_inputs"],
    ),
    "reader_serves_a_shortened_index": (
        "recipe/shards/reader.py",
        "            refuse_a_lost_index(self.root, self.records, self.manifest)\n",
        "            pass\n",
        ["tests/test_ownership.py::test_a_lost_index_is_rebuilt_from_the_shards_before_any_resume_decision"],
    ),
    "resume_stops_reading_a_shard_at_its_first_damage": (
        "recipe/shards/repair.py",
        '                if r["offset"] < size:\n                    framing.walk(m, r["offset"], found)\n',
        "                pass\n",
        ["tests/test_ownership.py::test_one_damaged_record_at_a_shards_start_or_end_costs_at_most_that_record"],
    ),
    "fp16_stored_as_bf16": (
        "recipe/schema.py",
        '            cfg.model.dtype == "bfloat16",\n',
        "            True,\n",
        [
            "tests/test_ownership.py::test_a_dtype_the_format_does_not_hold_is_refused_before_the_output_folder_is_opened"
        ],
    ),
    "writes_through_a_linked_folder": (
        "recipe/shards/store.py",
        "        refuse_links(self.root)\n",
        "",
        ["tests/test_ownership.py::test_nothing_is_written_through_a_symbolic_link"],
    ),
    "open_array_read_as_lines": (
        "recipe/data.py",
        "        return open_array(text)\n",
        "        return None\n",
        ["tests/test_ownership.py::test_every_record_is_a_sample_or_a_counted_skip_whatever_the_first_bytes"],
    ),
    "lost_identity_checks_the_old_keys_only": (
        "recipe/shards/store.py",
        "        keys = list(saved) if isinstance(saved, dict) else PROVENANCE_KEYS\n",
        "        keys = PROVENANCE_KEYS\n",
        ["tests/test_ownership.py::test_a_lost_identity_never_lets_other_settings_in"],
    ),
    "reader_trusts_an_edited_manifest_capture": (
        "recipe/shards/reader.py",
        """    if ident is not None and isinstance(ident.get("capture"), dict) and ident["capture"] != m["capture"]:""",
        "    if False:",
        ["tests/test_ownership.py::test_the_records_own_slots_outrank_an_edited_manifest"],
    ),
    "index_line_shapes_unchecked": (
        "recipe/shards/store.py",
        "        bad = repair_mod.problems(records)\n",
        "        bad = {}\n",
        ["tests/test_ownership.py::test_a_malformed_index_line_is_one_line_everywhere_and_a_resume_mends_it"],
    ),
    "bulk_line_judge_trusts_the_places": (
        "recipe/shards/repair.py",
        """    return (min(map(itemgetter("offset"), lines)) >= 0 and min(map(itemgetter("length"), lines)) >= 1""",
        """    return (min(map(itemgetter("length"), lines)) >= 1""",
        ["tests/test_ownership.py::test_a_long_index_judged_at_once_refuses_exactly_the_lines_judged_one_by_one"],
    ),
    "bulk_line_judge_takes_a_bool_for_an_int": (
        "recipe/shards/repair.py",
        "            if set(map(type, map(itemgetter(k), lines))) != {t}:",
        "            if not set(map(type, map(itemgetter(k), lines))) <= {t, bool}:",
        ["tests/test_ownership.py::test_a_long_index_judged_at_once_refuses_exactly_the_lines_judged_one_by_one"],
    ),
    "edited_key_not_settled": (
        "recipe/main.py",
        "        store.settle(the_plan.samples)\n",
        "",
        ["tests/test_ownership.py::test_an_edited_index_field_is_mended_from_the_record"],
    ),
    "merge_accepts_a_damaged_input": (
        "recipe/shards/merge.py",
        "        problem = damaged(Path(d))\n",
        "        problem = None\n",
        ["tests/test_ownership.py::test_merge_refuses_a_damaged_input_and_verify_names_the_merged_sets_own_fix"],
    ),
    "tool_calls_dropped_by_the_template": (
        "recipe/data.py",
        "            template_renders(tokenizer, msgs, tools, kwargs)\n",
        "",
        ["tests/test_ownership.py::test_tool_calls_train_on_what_the_template_renders_or_are_refused_saying_why"],
    ),
    "cut_without_its_margin": (
        "recipe/data.py",
        "CUT_MARGIN = 64\n",
        "CUT_MARGIN = 0\n",
        ["tests/test_boundaries.py::test_the_sample_is_the_whole_conversations_first_max_length_tokens_around_the_cut"],
    ),
    "empty_assistant_turns_accepted": (
        "recipe/data.py",
        """ and (m["content"].strip() or m.get("tool_calls")) for m in out)""",
        """ for m in out)""",
        ["tests/test_boundaries.py::test_a_conversation_whose_assistant_turns_are_all_empty_is_never_a_sample"],
    ),
    "duplicates_count_as_invalid": (
        "recipe/data.py",
        'POLICY_SKIPS = {"too_long", "duplicate", "no_loss_tokens"}',
        'POLICY_SKIPS = {"too_long", "no_loss_tokens"}',
        ["tests/test_boundaries.py::test_policy_skips_never_count_against_max_failures"],
    ),
    "resume_checks_only_a_shards_first_record": (
        "recipe/shards/repair.py",
        "all(_names_its_record(m, r) for r in (recs[0], recs[-1]))",
        "all(_names_its_record(m, r) for r in (recs[0],))",
        ["tests/test_ownership.py::test_one_damaged_record_at_a_shards_start_or_end_costs_at_most_that_record"],
    ),
    "speculators_pre_norm_slot_in_float32": (
        "recipe/shards/export.py",
        "    return x.to(post.dtype)\n",
        "    return x\n",
        ["tests/test_export.py::test_every_exported_tensor_has_the_targets_dtype_and_the_size_its_shape_implies"],
    ),
    "identity_without_overflow": (
        "recipe/provenance.py",
        '            "overflow": cfg.data.overflow.value,\n',
        "",
        ["tests/test_boundaries.py::test_every_setting_that_changes_a_sample_is_in_the_identity"],
    ),
    "reap_ignores_the_start_time": (
        "recipe/backends/sglang.py",
        'if pid and proc_start_time(pid) == rec.get("start"):',
        "if pid:",
        ["tests/test_boundaries.py::test_a_stale_server_record_never_kills_a_process_that_reused_its_pid"],
    ),
    "one_restart_too_many": (
        "recipe/backends/sglang.py",
        "if self.restarts >= self.opts.max_restarts:",
        "if self.restarts > self.opts.max_restarts:",
        ["tests/test_boundaries.py::test_max_restarts_allows_exactly_n_restarts"],
    ),
    "layer_equal_to_depth_accepted": (
        "recipe/schema.py",
        "(layers[0] < 0 or layers[-1] >= n)",
        "(layers[0] < 0 or layers[-1] > n)",
        ["tests/test_boundaries.py::test_every_capture_layer_is_a_residual_stream_input_at_both_ends"],
    ),
    "atomic_replace_without_its_folders_fsync": (
        "recipe/shards/store.py",
        "    os.replace(tmp, path)  # a link at `path` is replaced, never followed\n    fsync_path(path.parent)\n",
        "    os.replace(tmp, path)  # a link at `path` is replaced, never followed\n",
        ["tests/test_boundaries.py::test_every_replace_of_a_file_the_recipe_owns_is_made_durable_by_its_folders_fsync"],
    ),
    "merge_ignores_the_tokenizer": (
        "recipe/shards/merge.py",
        "    return identity_diff(a, b, names=names, ignore=JOB_SPLIT)\n",
        '    return identity_diff(a, b, names=names, ignore=JOB_SPLIT | {"tokenizer"})\n',
        ["tests/test_boundaries.py::test_merge_and_resume_refuse_exactly_the_same_identity_differences"],
    ),
    "resume_trusts_the_index_place": (
        "recipe/shards/repair.py",
        (
            """return header["meta"].get("id") == r["id"] and header["meta"].get("key", r["key"]) == r["key"]""",
            "if same and not deep:",
        ),
        ("return True", "if not deep:"),
        ["tests/test_integrity.py::test_a_resume_drops_lines_whose_place_holds_another_sample"],
    ),
    "resume_keeps_duplicate_lines": (
        "recipe/shards/repair.py",
        """        if x["id"] in seen:\n""",
        "        if False:\n",
        ["tests/test_integrity.py::test_a_resume_repairs_a_line_listed_twice"],
    ),
    "deep_check_skips_the_crc": (
        "recipe/shards/repair.py",
        """if framing.crc_of(self.m, r["offset"], length) != r["crc32"]:""",
        "if False:",
        ["tests/test_integrity.py::test_a_flipped_byte_is_found_by_a_deep_resume_and_redone"],
    ),
    "sweep_folders_ignore_the_data": (
        "conf/config.yaml",
        "exclude_keys: [output_dir, capture.dump_dir, log_every_s, hydra/launcher]",
        "exclude_keys: [output_dir, capture.dump_dir, log_every_s, hydra/launcher, data.sources]",
        ["tests/test_config.py::test_a_sweep_over_data_files_gives_each_its_own_folder"],
    ),
    "run_folder_ignores_the_data": (
        "recipe/schema.py",
        'f"{_root_.model.name}/{data_tag(d.sources)}{regen}/"',
        'f"{_root_.model.name}/"',
        ["tests/test_config.py::test_the_default_output_dir_is_named_from_model_and_capture_not_the_clock"],
    ),
    "null_columns_count_as_fields": (
        "recipe/data.py",
        "rec = {k: v for k, v in rec.items() if v is not None}",
        "pass",
        ["tests/test_data.py::test_a_local_hf_dataset_gives_the_same_samples_as_its_jsonl"],
    ),
    "a_stream_read_twice": (
        "recipe/data.py",
        "    if path.is_file() or path.is_dir():\n        return path\n",
        "    return path\n",
        ["tests/test_data.py::test_compressed_lines_json_arrays_and_stdin_read_as_the_plain_file"],
    ),
    "run_waits_on_the_servers_drain": (
        "recipe/backends/sglang.py",
        "self.stopping = self.server.stop_in_background(grace_s=self.opts.stop_grace_s)",
        "self.server.stop(grace_s=self.opts.stop_grace_s)",
        ["tests/test_sglang_backend.py::test_the_run_ends_without_waiting_on_the_servers_drain_and_after_the_server"],
    ),
    "end_of_run_stop_drains": (  # the run's exit waits out SGLang's drain of seconds for nothing
        "recipe/backends/sglang.py",
        "stop_in_background(grace_s=self.opts.stop_grace_s)",
        "stop_in_background()",
        ["tests/test_sglang_backend.py::test_the_run_ends_without_waiting_on_the_servers_drain_and_after_the_server"],
    ),
    "progress_talks_before_the_capture": (  # "0 samples/s" and a compile note while the server starts
        "recipe/packer/progress.py",
        "        if not (self.capturing or force):\n            return\n",
        "",
        ["tests/test_pipeline.py::test_progress_is_quiet_until_the_capture_starts_and_then_notes_a_slow_first_sample"],
    ),
    "progress_counts_the_server_start": (
        "recipe/packer/progress.py",
        "        self.t0 = self.last = time.monotonic()\n        self.capturing = True\n",
        "        self.capturing = True\n",
        ["tests/test_pipeline.py::test_progress_counts_from_the_capture_start_and_gives_an_eta"],
    ),
    "too_long_at_max_length": (
        "recipe/data.py",
        "truncated = len(ids) > data_cfg.max_length",
        "truncated = len(ids) >= data_cfg.max_length",
        ["tests/test_data.py::test_a_record_of_exactly_max_length_tokens_is_kept_whole"],
    ),
    "reasoning_left_out_of_the_id": (
        "recipe/data.py",
        """+ ([m["reasoning_content"]] if "reasoning_content" in m else [])""",
        "",
        ["tests/test_data.py::test_records_that_differ_only_in_reasoning_are_distinct_samples_or_a_counted_duplicate"],
    ),
    "same_tokens_not_a_duplicate": (
        "recipe/data.py",
        "if same != sid:",
        "if False:",
        ["tests/test_data.py::test_records_that_differ_only_in_reasoning_are_distinct_samples_or_a_counted_duplicate"],
    ),
    "dump_folder_readable_by_all": (
        "recipe/capture/dumpdir.py",
        ("root.mkdir(mode=0o700, exist_ok=True)", "if st.st_mode & 0o077:", "tmp.mkdir(mode=0o700)"),
        ("root.mkdir(exist_ok=True)", "if False:", "tmp.mkdir()"),
        ["tests/test_integrity.py::test_dump_folders_are_private_and_a_root_run_never_locks_a_user_out"],
    ),
    "damaged_next_trusted": (
        "recipe/shards/store.py",
        "return read_owned(nxt, int, NEXT_FIX) if nxt.exists() else 0",
        "return int(nxt.read_text()) if nxt.exists() else 0",
        ["tests/test_integrity.py::test_a_damaged_file_the_recipe_owns_is_one_line_naming_the_file_and_the_fix"],
    ),
    "reader_trusts_the_index_line": (
        "recipe/shards/reader.py",
        'if meta.get("id") != line["id"]:',
        "if False:",
        ["tests/test_integrity.py::test_a_reader_refuses_an_index_line_that_points_at_another_samples_record"],
    ),
    "readers_serve_duplicate_lines": (
        "recipe/shards/reader.py",
        "if refuse_duplicates and len(self.by_id) != len(self.records):",
        "if False:",
        ["tests/test_integrity.py::test_readers_and_exports_refuse_an_index_that_lists_a_sample_twice"],
    ),
    "specforge_direct_order_numeric": (
        "recipe/shards/trainers.py",
        "order = sorted(range(len(self.dataset(root))), key=specforge_file)",
        "order = range(len(self.dataset(root)))",
        ["tests/test_export.py::test_specforge_trainer_reads_the_shards_as_it_reads_an_export"],
    ),
    "speculators_gain_ignores_one_plus_w": (
        "recipe/shards/export.py",
        "return w.float() + 1 if kind in ZERO_CENTERED else w",
        "return w",
        [
            "tests/test_export.py::test_speculators_teacher_is_right_for_a_one_plus_w_norm_and_refused_where_speculators_reads_w"
        ],
    ),
    "hook_reads_packed_aux_as_rows": (
        "recipe/capture/sglang_hook.py",
        "    return list(aux.split(hidden, dim=-1))",
        "    return list(aux)",
        ["tests/test_sglang_hook.py::test_aux_packed_side_by_side_dumps_as_the_list_does"],
    ),
    "token_counts_trust_a_file_of_other_samples": (
        "recipe/shards/tokencounts.py",
        (
            "    if counts.lines > len(records) or digest_of(records[: counts.lines]) != counts.digest:\n"
            "        return False\n"
            "    head = records[: counts.lines]\n"
            '    if int(counts.all.sum()) != sum(r.get("tokens", 0) for r in head):\n'
            "        return False\n"
            '    return all("loss_tokens" not in r for r in head) or int(counts.loss.sum()) == sum(\n'
            '        r.get("loss_tokens", 0) for r in head\n'
            "    )\n"
        ),
        "    return counts.lines <= len(records)\n",
        ["tests/test_token_counts.py::test_a_counts_file_that_is_gone_damaged_or_foreign_is_counted_again"],
    ),
    "token_counts_stop_at_the_file": (
        "recipe/shards/tokencounts.py",
        "    return catch_up(counts, root, records, cache)",
        "    return counts",
        ["tests/test_token_counts.py::test_counts_are_exact_after_kill_9_and_the_resume"],
    ),
    "token_counts_order_ids_ascending": (
        "recipe/shards/tokencounts.py",
        'order = seen[np.argsort(self.first[seen], kind="stable")]',
        "order = seen",
        ["tests/test_token_counts.py::test_counts_are_exact_after_a_run_and_a_narrower_then_a_wider_resume"],
    ),
    "specforge_mapping_breaks_ties_by_id": (
        "recipe/shards/vocabmap.py",
        "key=lambda i: -weight.get(order[i], 0))",
        "key=lambda i: (-weight.get(order[i], 0), order[i]))",
        ["tests/test_vocabmap.py::test_specforge_mapping_is_what_specforges_own_function_builds"],
    ),
    "speculators_mapping_breaks_ties_first_seen": (
        "recipe/shards/vocabmap.py",
        "ids[np.lexsort((ids, -freq))]",
        'ids[np.argsort(-freq, kind="stable")]',
        ["tests/test_vocabmap.py::test_speculators_mapping_and_frequencies_are_what_its_own_functions_build"],
    ),
    "fp8_ties_away_from_even": (
        "recipe/shards/_fp8.c",
        "uint32_t normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);",
        "uint32_t normal = ((a + 0x80000u) >> 20) - (120u << 3);",
        ["tests/test_fp8.py::test_codes_and_values_are_torchs_own_float8_e4m3fn"],
    ),
    "fp8_error_sums_drop_a_rows_last_values": (
        "recipe/shards/_fp8.c",
        "        for (; i < width; i++) {\n            e2 += d2[i];",
        "        for (; i < i; i++) {\n            e2 += d2[i];",
        ["tests/test_fp8.py::test_codes_and_values_are_torchs_own_float8_e4m3fn"],
    ),
    "fp8_groups_follow_the_pieces": (
        "recipe/packer/worker.py",
        "    for row, hi, lo in groups(((r, h, lo) for (r, h), (_, lo) in pairs), fp8.group_tokens(slots, hidden)):",
        "    for row, hi, lo in ((r, h, lo) for (r, h), (_, lo) in pairs):",
        ["tests/test_fp8.py::test_a_chunked_sample_is_stored_in_whole_groups_whatever_its_pieces"],
    ),
    "fp8_numpy_ties_away_from_even": (
        "recipe/shards/fp8.py",
        "    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20)",
        "    normal = ((b + 0x80000) >> 20)",
        ["tests/test_fp8.py::test_codes_and_values_are_torchs_own_float8_e4m3fn"],
    ),
    "fp8_numpy_subnormal_ties_away_from_even": (
        "recipe/shards/fp8.py",
        "    sub = np.rint(a * np.float32(512)).astype(np.int32)",
        "    sub = np.floor(a * np.float32(512) + 0.5).astype(np.int32)",
        ["tests/test_fp8.py::test_codes_and_values_are_torchs_own_float8_e4m3fn"],
    ),
    "fp8_numpy_casts_nan_loudly": (
        "recipe/shards/fp8.py",
        '    with np.errstate(invalid="ignore", over="ignore"):  # a NaN/Inf block, which the plane check refuses',
        "    if True:",
        ["tests/test_fp8.py::test_numpy_quantizes_a_non_finite_block_quietly_and_finite_rows_as_before"],
    ),
    "fp8_identity_without_the_codec": (
        "recipe/provenance.py",
        '**({"codec": codec_name(cfg.shards.codec)} if cfg.shards.codec != "lossless" else {}),',
        "",
        ["tests/test_fp8.py::test_a_set_never_holds_both_codecs"],
    ),
    "patch_hooks_after_pruning": (
        "patches/sglang/v0.5.16/logits_processor.patch",
        (
            "+        if self.hs_dump is not None:  # hs-recipe: the pass's states, before anything is pruned\n"
            "+            self.hs_dump(logits_metadata, hidden_states, aux_hidden_states)\n"
            "         # Extract MIS indices before ForwardBatch → LogitsMetadata conversion\n"
            "         multi_item_delimiter_indices = None\n"
        ),
        (
            "         # Extract MIS indices before ForwardBatch → LogitsMetadata conversion\n"
            "         multi_item_delimiter_indices = None\n"
            "+        if self.hs_dump is not None:  # hs-recipe: the pass's states, before anything is pruned\n"
            "+            self.hs_dump(logits_metadata, hidden_states, aux_hidden_states)\n"
        ),
        ["tests/test_patch.py::test_the_hook_runs_first_in_every_logits_processor_and_only_where_the_seam_set_it"],
    ),
    "compiled_join_swaps_planes": (
        "recipe/shards/_join.c",
        "out[i] = (uint16_t)(high[i] << 8 | low[i]);",
        "out[i] = (uint16_t)(low[i] << 8 | high[i]);",
        ["tests/test_roundtrip.py::test_both_plane_joins_give_the_stored_words"],
    ),
    "coverage_one_short": (
        "recipe/packer/scan.py",
        "if covered >= n and p.responded_at is not None:",
        "if covered >= n - 1 and p.responded_at is not None:",
        ["tests/test_guarantees.py::test_the_packer_waits_for_the_last_token_and_for_the_response"],
    ),
    "pack_before_response": (
        "recipe/packer/scan.py",
        "if covered >= n and p.responded_at is not None:",
        "if covered >= n:",
        ["tests/test_guarantees.py::test_the_packer_does_not_pack_before_the_response"],
    ),
    "inf_not_flagged": (
        "recipe/packer/checks.py",
        "if (lo[top] >= 0x80).any():",
        "if (lo[top] > 0x80).any():",
        ["tests/test_guarantees.py::test_bad_values_are_refused"],
    ),
    "crc_not_checked": (
        "recipe/shards/codec.py",
        "    if expected is not None and got != expected:",
        "    if False:",
        [
            "tests/test_guarantees.py::test_a_wrong_crc_is_reported_and_raised",
            "tests/test_roundtrip.py::test_a_record_decoded_in_steps_is_the_stored_record_and_lets_its_pages_go",
        ],
    ),
    "index_before_shard_fsync": (
        "recipe/shards/store.py",
        '            self._fsync_shards({r["shard"] for r in batch})\n',
        "",
        [
            "tests/test_guarantees.py::test_commit_makes_the_shard_durable_before_the_index_names_it",
            "tests/test_guarantees.py::test_the_packer_workers_shards_are_fsynced_before_the_index_names_them",
        ],
    ),
    "tail_not_truncated": (
        "recipe/shards/store.py",
        "            os.ftruncate(fd, at)\n",
        "            pass\n",
        [
            "tests/test_guarantees.py::test_a_crash_between_append_and_commit_keeps_the_whole_record_and_cuts_the_torn_one"
        ],
    ),
    "ids_snapshot_removed": (
        "recipe/capture/sglang_hook.py",
        "ids = fb.input_ids[lo:hi].clone()",
        "ids = fb.input_ids[lo:hi]",
        ["tests/test_guarantees.py::test_the_hook_snapshots_ids_before_sglang_refills_its_buffers"],
    ),
    "job_split_not_modulo": (
        "recipe/data.py",
        "mine = index % data_cfg.num_shards == data_cfg.shard_index",
        "mine = index * data_cfg.num_shards // max(data_cfg.limit or 1, 1) == data_cfg.shard_index",
        ["tests/test_data.py::test_job_split_partitions_the_input"],
    ),
    # writer and reader swap the planes together, so our reader would agree with itself; the packer's
    # value check (which reads the documented high plane) and the FORMAT.md reader do not
    "byteplanes_low_first": (
        ("recipe/capture/records.py", "recipe/shards/codec.py"),
        (
            "split_into(w, out[0].reshape(-1), out[1].reshape(-1), np.empty_like(w))",
            "    if out is None:\n        out = np.empty(high.shape, np.uint16)\n",
        ),
        (
            "split_into(w, out[1].reshape(-1), out[0].reshape(-1), np.empty_like(w))",
            "    high, low = low, high  # both joins, compiled and numpy's\n"
            "    if out is None:\n        out = np.empty(high.shape, np.uint16)\n",
        ),
        ["tests/test_guarantees.py::test_an_independent_reader_from_the_format_doc_decodes_the_shards"],
    ),
    "rollover_ignored": (
        "recipe/packer/pool.py",
        "if shard is None or shard[1] >= self.store.max_shard_bytes:",
        "if shard is None:",
        ["tests/test_integrity.py::test_a_deleted_or_truncated_shard_is_named_by_verify_and_redone_by_resume"],
    ),
    "shard_name_by_count": (
        "recipe/shards/store.py",
        "n = max(shard_number(names[-1]) + 1 if names else 0, self.next_number())",
        "n = len(list((self.root / SHARD_DIR).glob('shard-*.bin')))",
        ["tests/test_integrity.py::test_a_deleted_or_truncated_shard_is_named_by_verify_and_redone_by_resume"],
    ),
    "identity_not_checked": (
        "recipe/shards/store.py",
        "        diff = identity_diff(old, identity)\n        if diff:",
        "        diff = identity_diff(old, identity)\n        if False:",
        ["tests/test_integrity.py::test_a_resume_with_another_configuration_is_refused_even_without_a_manifest"],
    ),
    "duplicate_id_accepted": (
        "recipe/shards/store.py",
        "if key in self.keys or sample_id in self.ids:",
        "if key in self.keys:",
        ["tests/test_integrity.py::test_a_sample_id_is_stored_at_most_once"],
    ),
    "dump_cleanup_by_pid": (
        "recipe/capture/dumpdir.py",
        "                    continue  # a live run holds it",
        "                    pass  # (mutant: the lock is ignored)",
        ["tests/test_integrity.py::test_runs_in_separate_pid_namespaces_never_remove_each_others_dump_folder"],
    ),
    "server_without_pdeathsig": (
        "recipe/backends/sglang.py",
        "            preexec_fn=die_with_parent(os.getpid()),\n",
        "",
        ["tests/test_integrity.py::test_kill_9_takes_the_server_along_and_the_resume_finishes"],
    ),
    "unknown_keys_ignored": (
        "recipe/schema.py",
        "    unknown = unknown_keys(cfg, Config)\n",
        "    unknown = []\n",
        ["tests/test_integrity.py::test_bad_config_fails_first_in_one_line"],
    ),
    # caught before, kept caught
    "slots_swapped": (
        "recipe/backends/hf.py",
        "picks = [hs[i] for i in self.layers] + ([hs[self.num_layers]] if self.final else [])",
        "picks = [hs[i] for i in self.layers[::-1]] + ([hs[self.num_layers]] if self.final else [])",
        ["tests/test_roundtrip.py"],
    ),
    "rid_prefix_ignored": (
        "recipe/capture/writer.py",
        "ours = [i for i, rid in enumerate(rids) if rid.startswith(self.rid_prefix)]",
        "ours = list(range(len(rids)))",
        ["tests/test_sglang_hook.py"],
    ),
    "mask_span_one_char_late": (
        "recipe/data.py",
        "spans.append((len(head), end))",
        "spans.append((len(head) + 1, end))",
        ["tests/test_data.py::test_loss_mask_boundaries"],
    ),
    "speculators_last_slot_post_norm": (
        "recipe/shards/export.py",
        "x = torch.where(w == 0, torch.zeros_like(w), post.float() / safe)",
        "x = post.float()",
        ["tests/test_export.py::test_speculators_trains_toward_what_the_target_predicts"],
    ),
    "specforge_ids_2d": (
        "recipe/shards/export.py",
        '        "input_ids": x["input_ids"].long(),\n        "loss_mask": x["loss_mask"].long(),\n',
        '        "input_ids": x["input_ids"].long()[None],\n        "loss_mask": x["loss_mask"].long()[None],\n',
        ["tests/test_export.py::test_specforge_dataset_and_collator_read_the_export_exactly"],
    ),
    "rewritten_turn_ends_early": (  # a history turn's mask stops before its end-of-turn marker
        "recipe/data.py",
        "end = at + len(marker)",
        "end = at",
        ["tests/test_kimi.py::test_multi_turn_masks_survive_a_template_that_drops_earlier_reasoning"],
    ),
    "slow_tokenizer_mask_shifted": (  # pieces of a slow tokenizer masked one piece late
        "recipe/data.py",
        "mask += [int(any(s <= a and b <= e for s, e in spans))] * len(piece)",
        "mask += [int(any(s < a and b <= e for s, e in spans))] * len(piece)",
        ["tests/test_kimi.py::test_multi_turn_masks_survive_a_template_that_drops_earlier_reasoning"],
    ),
    "refused_bytes_left_in_shard": (  # a sample refused after streaming keeps its bytes in the shard
        "recipe/packer/worker.py",
        "                if out.length:  # refused after streaming: its bytes leave the shard again",
        "                if False:",
        ["tests/test_roundtrip.py::test_values_are_checked_as_they_stream_past_and_a_refused_sample_leaves_no_bytes"],
    ),
    "zero_slot_seen_in_first_block_only": (  # the low plane of later blocks never clears a zero slot
        "recipe/packer/checks.py",
        "        if zero.any():",
        "        if zero.any() and row == 0:",
        ["tests/test_roundtrip.py::test_values_are_checked_as_they_stream_past_and_a_refused_sample_leaves_no_bytes"],
    ),
    "mapped_shard_size_unchecked": (
        "recipe/shards/reader.py",
        "                if size < end:",
        "                if False:",
        ["tests/test_roundtrip.py::test_a_shard_cut_short_is_named_and_what_precedes_the_cut_still_reads"],
    ),
    "decode_buffer_shared_by_threads": (  # frame A's memory free for the next decode while still in use
        "recipe/shards/codec.py",
        "        header, body, off = _frame_a(frame, expected_crc, take)\n",
        "        header, body, off = _frame_a(frame, expected_crc, take)\n        recycler._give(body.base)\n",
        ["tests/test_roundtrip.py::test_threads_sharing_one_reader_get_their_own_samples"],
    ),
    "pool_buffer_back_before_written": (  # the next pass's copy overwrites a pass still being written
        "recipe/capture/writer_threads.py",
        (
            "                t1 = time.perf_counter()\n",
            "            finally:  # written (or failed): nothing reads the buffer any more\n"
            "                if self.pool is not None:\n"
            "                    self.pool.give(buf)\n",
        ),
        (
            "                t1 = time.perf_counter()\n                self.pool.give(buf)\n",
            "            finally:\n",
        ),
        ["tests/test_sglang_hook.py::test_a_pool_buffer_is_reused_only_after_its_pass_is_written"],
    ),
    "pool_pins_per_pass": (
        "recipe/capture/hostcopy.py",
        "                if b.numel() >= nbytes:  # the smallest that fits",
        "                if False:  # the smallest that fits",
        ["tests/test_sglang_hook.py::test_pinned_buffers_are_taken_from_the_pool_not_allocated_per_pass"],
    ),
    "output_memory_reused_while_viewed": (  # the finalizer watches nothing: memory back at once
        "recipe/shards/codec.py",
        "        weakref.finalize(arr, self._give, block)\n",
        "        self._give(block)\n",
        ["tests/test_roundtrip.py::test_a_samples_memory_is_reused_only_once_nothing_views_it"],
    ),
    "budget_ignores_other_writers": (  # writer threads each see room for one record and all write it
        "recipe/capture/writer.py",
        "                held = records.dir_bytes(self.dump_dir, reservations=True)\n",
        "                held = records.dir_bytes(self.dump_dir)\n",
        ["tests/test_reliability.py::test_dump_budget_is_never_exceeded"],
    ),
    "reservation_of_the_planes_only": (  # the record's ids and header go over the budget
        "recipe/capture/writer.py",
        "sum(records.record_bytes(r, o, p.shape, last) for r, o, _, p, last in pieces)",
        "sum(p.nbytes for r, o, _, p, last in pieces)",
        ["tests/test_reliability.py::test_dump_budget_is_never_exceeded"],
    ),
    "reservation_released_during_a_scan": (  # a record renamed mid-scan is missed and so is its claim
        "recipe/capture/writer.py",
        "            with self._lock, _locked(self.dump_dir):\n                token.unlink(missing_ok=True)\n",
        "            token.unlink(missing_ok=True)\n",
        ["tests/test_reliability.py::test_dump_budget_is_never_exceeded"],
    ),
    "every_rank_writes_the_whole_pass": (  # TP ranks hold the same states: each row twice
        "recipe/capture/sglang_hook.py",
        "    lo, hi = T * rank // size, T * (rank + 1) // size\n",
        "    lo, hi = 0, T\n",
        [
            "tests/test_sglang_hook.py::test_the_ranks_of_a_tp_group_each_write_their_share_and_every_row_once",
            "tests/test_sglang_hook.py::test_share_splits_a_pass_evenly_and_keeps_offsets",
        ],
    ),
    "restart_keeps_dead_claims": (  # a killed server's reservation holds the dump budget forever
        "recipe/backends/sglang.py",
        "            records.clear_reservations(self.dump_dir)  # the dead ranks' claims on the dump budget\n",
        "",
        ["tests/test_sglang_backend.py::test_server_death_restarts_and_resends"],
    ),
    "pool_sized_for_an_even_share": (  # the last rank's larger share grows a buffer in a timed pass
        "recipe/capture/sglang_hook.py",
        "rows = -(-self._pass_tokens // self._rank[1])",
        "rows = self._pass_tokens // self._rank[1]",
        ["tests/test_sglang_hook.py::test_the_pool_holds_the_largest_share_when_the_ranks_do_not_divide_the_pass"],
    ),
    "budget_lock_only_among_threads": (  # writer processes (TP ranks) check and reserve at once
        "recipe/capture/writer.py",
        "            with self._lock, _locked(self.dump_dir):\n                held",
        "            with self._lock:\n                held",
        ["tests/test_reliability.py::test_dump_budget_is_never_exceeded"],
    ),
    "recycled_memory_shared_with_forks": (  # a forked worker's decode lands in the parent's sample
        "recipe/shards/codec.py",
        "flags=mmap.MAP_PRIVATE)",
        "flags=mmap.MAP_SHARED)",
        [
            "tests/test_roundtrip.py::"
            "test_a_forked_worker_decoding_into_recycled_memory_leaves_the_parents_samples_alone"
        ],
    ),
    "verify_check_skips_frame_b": (  # verify passes a record whose low plane the reader refuses
        "recipe/shards/codec.py",
        '        _low_plane(frame, header, math.prod(tail["shape"]))',
        "        pass",
        ["tests/test_roundtrip.py::test_verify_refuses_every_record_the_reader_refuses"],
    ),
    "tensor_sizes_unchecked": (  # verify passes a record whose shape the reader cannot build
        "recipe/shards/codec.py",
        "    _check_sizes(header)\n    said = off",
        "    said = off",
        ["tests/test_roundtrip.py::test_verify_refuses_every_record_the_reader_refuses"],
    ),
    "index_read_at_once_miscounts_its_lines": (  # two records on one line read as two lines' records
        "recipe/shards/store.py",
        '    return records if end == len(text) and len(records) == raw.count(b"\\n", 0, cut) else None',
        "    return records if end == len(text) else None",
        ["tests/test_integrity.py::test_an_index_line_is_json_exactly_as_json_reads_it"],
    ),
    "frame_a_size_unchecked": (  # a short frame A read on into the raw tail
        "recipe/shards/codec.py",
        "    if said != size:  # zstd's reader would run on into frame B",
        "    if False:",
        ["tests/test_roundtrip.py::test_a_frame_a_that_disagrees_with_its_header_is_corrupt"],
    ),
    "int4_nibble_offset_off_by_one": (  # INT4 read back one step off: HF no longer the model SGLang serves
        "recipe/int4.py",
        ".to(torch.float32) - 8",
        ".to(torch.float32) - 7",
        ["tests/test_int4.py::test_our_dequantization_is_compressed_tensors_own_bit_for_bit"],
    ),
    "int4_quantizes_the_dense_mlp": (  # the real checkpoint keeps layer 0's dense MLP in bf16
        "recipe/int4.py",
        r'r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$"',
        r'r"\.mlp\.(experts\.\d+\.)?(gate|up|down)_proj\.weight$"',
        ["tests/test_int4.py::test_only_the_routed_experts_are_int4_named_and_shaped_as_the_real_checkpoint"],
    ),
    "drain_waits_past_a_failure": (  # a failed stage leaves samples outstanding forever: the run hangs
        "recipe/packer/scheduler.py",
        "        while self.outstanding():\n            if self.error:\n",
        "        while self.outstanding():\n            if False:\n",
        ["tests/test_shutdown.py::test_a_failure_in_any_packer_stage_ends_the_process[worker_bug]"],
    ),
    "resume_opens_new_shards": (  # every resume starts a new file per worker, even to redo one sample
        "recipe/shards/store.py",
        "return self._reusable.pop(0) if self._reusable else (self.new_shard_path(), 0)",
        "return (self.new_shard_path(), 0)",
        ["tests/test_integrity.py::test_a_resume_appends_to_the_sets_open_shards_rather_than_starting_new_files"],
    ),
    "resume_appends_to_a_left_shard": (  # bytes the repair could not prove were left: appending buries them
        "recipe/shards/store.py",
        "if f.name not in left and size == ends.get(f.name, 0) and size < max_bytes:",
        "if size < max_bytes:",
        ["tests/test_integrity.py::test_a_resume_never_appends_to_a_shard_whose_tail_it_left_alone"],
    ),
    "backend_gets_whole_config": (  # the registry hands a backend more than its own nodes
        "recipe/backends/__init__.py",
        "**{n: OmegaConf.to_object(cfg[n]) for n in nodes}",
        "**{n: OmegaConf.to_object(cfg[n]) for n in cfg if n in nodes or n == 'data'}",
        ["tests/test_config.py::test_registry_hands_each_backend_only_its_config_nodes"],
    ),
    # the commands around a run: export, repair, merge, the token counts (tests/test_edges.py)
    "export_overwrite_sees_only_its_top_folder": (
        "recipe/shards/aliasing.py",
        "    for top, dirs, _ in os.walk(path):",
        "    for top, dirs, _ in []:",
        ["tests/test_edges.py::test_export_overwrite_never_deletes_a_set_nested_anywhere_under_out"],
    ),
    "export_into_another_sets_folder": (
        "recipe/shards/export.py",
        "    if inside is not None:",
        "    if inside is not None and False:",
        ["tests/test_edges.py::test_export_into_another_set_is_refused"],
    ),
    "export_stages_under_a_fixed_name": (
        "recipe/shards/export.py",
        '    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))',
        '    stage = out.parent / f".{out.name}.export-partial"\n    shutil.rmtree(stage, ignore_errors=True)\n'
        "    stage.mkdir()",
        ["tests/test_edges.py::test_export_stages_in_a_folder_of_its_own_never_a_users"],
    ),
    "exports_share_their_lock": (
        "recipe/shards/export.py",
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
        ["tests/test_edges.py::test_a_second_export_into_the_same_out_is_refused_while_one_runs"],
    ),
    "a_stray_shards_records_indexed": (
        "recipe/shards/repair.py",
        "why = foreign(w.m[at : at + w.found[at][0]], w.found[at][1]) if foreign else None",
        "why = None",
        ["tests/test_edges.py::test_a_stray_shard_of_another_set_is_never_indexed_or_served"],
    ),
    "a_stray_of_another_model_indexed": (
        "recipe/shards/belonging.py",
        'if sample_key(fingerprint, capture, ids) != meta.get("key"):',
        "if False:",
        ["tests/test_edges.py::test_a_stray_shard_of_another_model_at_the_same_layers_is_never_indexed"],
    ),
    "repair_cuts_through_a_hard_link": (
        "recipe/shards/store.py",
        "if os.fstat(fd).st_nlink > 1:",
        "if os.fstat(fd).st_nlink > 2:",
        ["tests/test_edges.py::test_repair_never_cuts_a_tail_a_hard_link_shares_with_a_live_set"],
    ),
    "merge_links_only_shard_named_files": (
        "recipe/shards/merge.py",
        'for name in sorted({r["shard"] for r in index}):',
        'for name in sorted(f.name for f in (d / SHARD_DIR).glob("shard-*.bin")):',
        ["tests/test_edges.py::test_merging_merged_sets_gives_a_whole_set"],
    ),
    "token_counts_totals_unchecked": (
        "recipe/shards/tokencounts.py",
        "    head = records[: counts.lines]\n",
        "    return True\n    head = records[: counts.lines]\n",
        ["tests/test_edges.py::test_counts_whose_totals_disagree_with_the_index_are_never_used"],
    ),
    "verify_trusts_the_token_counts": (
        "recipe/shards/verify.py",
        "counted = None if problems else tokencounts.problem(root, r.records, counts)",
        "counted = None",
        ["tests/test_edges.py::test_edited_token_counts_are_caught_by_verify_and_rebuilt_by_repair"],
    ),
    "verify_keeps_only_the_last_ranges_counts": (
        "recipe/shards/verify.py",
        "            counts.extend(tokencounts.Counts.of_sparse(part.counts))",
        "            counts = tokencounts.Counts.of_sparse(part.counts)",
        ["tests/test_edges.py::test_verify_counts_tokens_in_its_workers_as_one_reader_counts_them_in_order"],
    ),
    "token_counts_rank_new_ids_in_position_order": (
        "recipe/shards/tokencounts.py",
        '        new = new[np.lexsort((new, np.searchsorted(ends, firsts, side="right")))]',
        "        pass",
        ["tests/test_token_counts.py::test_counts_are_exact_after_a_run_and_a_narrower_then_a_wider_resume"],
    ),
    "fp8_in_numpy_passes_unannounced": (
        "recipe/preflight.py",
        '    if codec == "fp8" and fp8.IMPL != "compiled":',
        '    if codec == "fp8" and fp8.IMPL == "compiled":',
        ["tests/test_fp8.py::test_a_run_that_would_quantize_in_numpy_says_so_before_any_gpu_work"],
    ),
    "preflight_states_the_lossless_ratio_for_every_codec": (
        "recipe/main.py",
        "                        cfg.shards.codec)  # fmt: skip",
        '                        "lossless")  # fmt: skip',
        ["tests/test_fp8.py::test_a_run_that_would_quantize_in_numpy_says_so_before_any_gpu_work"],
    ),
    "token_counts_first_places_grown_as_zero": (
        "recipe/shards/tokencounts.py",
        '("first", -1), ("place", UNSET)):',
        '("first", -1), ("place", 0)):',
        ["tests/test_token_counts.py::test_samples_counted_at_once_rank_and_sum_as_a_counter_filled_one_by_one"],
    ),
    "token_counts_join_a_short_mask_beside_a_long_one": (
        "recipe/shards/tokencounts.py",
        "        if sizes != [m.size for m in masks]:",
        "        if sum(sizes) != sum(m.size for m in masks):",
        ["tests/test_token_counts.py::test_samples_counted_at_once_rank_and_sum_as_a_counter_filled_one_by_one"],
    ),
    "token_counts_of_many_samples_rank_new_ids_by_id_alone": (
        "recipe/shards/tokencounts.py",
        '        new = new[np.lexsort((new, np.searchsorted(ends, firsts, side="right")))]',
        "        new = np.sort(new)",
        ["tests/test_token_counts.py::test_samples_counted_at_once_rank_and_sum_as_a_counter_filled_one_by_one"],
    ),
    "repair_keeps_edited_token_counts": (
        "recipe/shards/mend.py",
        "recounted = deep and recount(store)",
        "recounted = False",
        ["tests/test_edges.py::test_edited_token_counts_are_caught_by_verify_and_rebuilt_by_repair"],
    ),
    "token_ids_saved_as_uint16": (
        "recipe/shards/tokencounts.py",
        "loss_ids=ids.astype(np.int32)",
        "loss_ids=ids.astype(np.uint16)",
        ["tests/test_edges.py::test_token_ids_past_65535_round_trip_a_200k_vocabulary"],
    ),
    "a_cut_shard_hides_its_other_damage": (
        "recipe/shards/verify.py",
        'why, got = (None, None) if rec["id"] in lost else',
        'why, got = (None, None) if any(x["id"] in lost for x in r.records if x["shard"] == rec["shard"]) else',
        ["tests/test_edges.py::test_a_shard_cut_short_does_not_hide_other_damage_in_it"],
    ),
    "repair_silent_on_a_damaged_unindexed_record": (
        "recipe/shards/repair.py",
        'damaged.append((str(rid), f"its record in {name} at {at} is damaged ({e})"))',
        "pass",
        ["tests/test_edges.py::test_with_the_index_lost_repair_names_the_damaged_record"],
    ),
    "verify_calls_a_damaged_unindexed_record_whole": (
        "recipe/shards/coverage.py",
        "broken = None if sid in ids or why is not None else _undecodable(m, pos, rec[0])",
        "broken = None",
        ["tests/test_edges.py::test_with_the_index_lost_repair_names_the_damaged_record"],
    ),
    "repair_leaves_the_manifests_ok_count": (
        "recipe/shards/mend.py",
        'fixed["counts"] = recounted_ok(manifest["counts"], len(store.records))',
        "pass",
        ["tests/test_edges.py::test_the_manifest_straight_after_a_repair_agrees_with_the_index"],
    ),
    # the inputs a user has (tests/test_inputs.py)
    "null_content_read_as_empty": (
        "recipe/data.py",
        "    if content is None and not calls:  # never read",
        "    if False:  # never read",
        ["tests/test_inputs.py::test_null_content_without_tool_calls_is_refused_by_name_never_read_as_empty"],
    ),
    "a_cut_zst_read_as_a_shorter_file": (
        "recipe/sources.py",
        'raise EOFError("the file ends inside a zstd frame")',
        "return 0",
        ["tests/test_inputs.py::test_a_cut_compressed_input_is_one_line_naming_it"],
    ),
    "a_folder_read_out_of_name_order": (
        "recipe/data.py",
        "for f in sources.folder_files(path):",
        "for f in reversed(sources.folder_files(path)):",
        ["tests/test_inputs.py::test_a_folder_of_jsonl_files_is_read_in_name_order"],
    ),
    "the_first_split_read_whatever_is_named": (
        "recipe/sources.py",
        "        ds = ds[split]",
        "        ds = ds[next(iter(ds))]",
        ["tests/test_inputs.py::test_a_dataset_dict_reads_the_named_split_and_names_the_rest"],
    ),
    "text_parts_joined_with_a_space": (
        "recipe/data.py",
        'return "".join(texts)',
        'return " ".join(texts)',
        ["tests/test_inputs.py::test_content_as_a_list_of_text_parts_reads_as_its_text"],
    ),
    "tools_left_out_of_the_prompt": (
        "recipe/data.py",
        'kwargs = {**kwargs, "tools": tools} if tools else kwargs',
        "kwargs = kwargs",
        ["tests/test_inputs.py::test_tools_are_tokenized_as_the_template_renders_them"],
    ),
    "array_sniffed_in_the_first_64_bytes": (
        "recipe/data.py",
        "head = f.peek(1 << 16)[: 1 << 16].lstrip(",
        "head = f.peek(64)[:64].lstrip(",
        ["tests/test_inputs.py::test_a_json_array_after_whitespace_or_a_bom_is_read_as_an_array"],
    ),
    # every failure of the shard commands is one line (tests/test_failures.py)
    "ctrl_c_is_a_traceback": (
        "recipe/shards/__main__.py",
        "    except KeyboardInterrupt:  # what was committed stays",
        "    except ZeroDivisionError:  # what was committed stays",
        ["tests/test_failures.py::test_ctrl_c_is_one_line_and_the_same_command_then_finishes"],
    ),
    "a_read_only_folder_is_a_traceback": (
        "recipe/shards/__main__.py",
        "if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):",
        "if e.errno in (errno.EACCES, errno.EPERM):",
        ["tests/test_failures.py::test_a_read_only_destination_is_one_line"],
    ),
    "a_merge_rerun_refuses_its_own_copies": (
        "recipe/shards/merge.py",
        "(os.path.samefile(src, dst) or filecmp.cmp(src, dst, shallow=False))",
        "os.path.samefile(src, dst)",
        ["tests/test_failures.py::test_a_merge_killed_while_copying_reruns_to_a_whole_set"],
    ),
    "a_refused_store_keeps_its_lock": (
        "recipe/shards/store.py",
        "        finally:  # whatever was raised (a refusal too), the lock goes with the store\n",
        "        except Exception:\n            raise\n        if True:\n",
        ["tests/test_failures.py::test_token_counts_that_are_a_folder_are_one_line_and_the_advice_fixes_it"],
    ),
    "token_counts_replaced_over_a_folder": (
        "recipe/shards/tokencounts.py",
        "    if (Path(root) / FILE).is_dir():",
        "    if False:",
        ["tests/test_failures.py::test_token_counts_that_are_a_folder_are_one_line_and_the_advice_fixes_it"],
    ),
    "draft_vocab_checked_after_the_samples": (
        "recipe/shards/export.py",
        "    if draft_vocab is not None:  # before a sample is written",
        "    if False:  # before a sample is written",
        ["tests/test_failures.py::test_a_bad_draft_vocab_is_refused_before_any_sample_is_written"],
    ),
    "rebuild_index_silent_on_damage": (
        "recipe/shards/__main__.py",
        'damaged.append((f"{shard.name} @ {at}", str(e)))',
        "pass",
        ["tests/test_failures.py::test_rebuild_index_over_a_damaged_record_names_it_and_indexes_the_rest"],
    ),
    # sizes at their edges, the self-check at a real logit scale
    "target_vocab_taken_from_the_checkpoint": (
        "recipe/shards/vocabmap.py",
        "    if given is not None:  # 0 too",
        "    if False:  # 0 too",
        ["tests/test_vocabmap.py::test_export_takes_the_target_vocabulary_from_the_argument_not_the_checkpoint"],
    ),
    "a_zero_target_vocab_read_as_not_given": (
        "recipe/shards/vocabmap.py",
        "    if given is not None:  # 0 too",
        "    if given:  # 0 too",
        ["tests/test_vocabmap.py::test_every_size_at_its_edges_is_kept_or_refused_in_one_line"],
    ),
    "a_draft_as_wide_as_its_target_refused": (
        "recipe/shards/vocabmap.py",
        "    if draft < 1 or draft > target:",
        "    if draft < 1 or draft >= target:",
        ["tests/test_vocabmap.py::test_every_size_at_its_edges_is_kept_or_refused_in_one_line"],
    ),
    "the_sets_top_id_inside_a_target_one_short": (
        "recipe/shards/vocabmap.py",
        "    if seen.size and seen[-1] >= target:",
        "    if seen.size and seen[-1] > target:",
        ["tests/test_vocabmap.py::test_every_size_at_its_edges_is_kept_or_refused_in_one_line"],
    ),
    "self_check_bound_ten_times_looser": (
        "recipe/selfcheck.py",
        "    return 0.02 + 2.0**-7 * max_logit",
        "    return 10 * (0.02 + 2.0**-7 * max_logit)",
        ["tests/test_selfcheck.py::test_a_final_slot_one_layer_early_is_flagged_at_nearly_every_position_and_refused"],
    ),
    "self_check_logits_without_their_softcap": (
        "recipe/selfcheck.py",
        "        if self.softcap:\n",
        "        if False:\n",
        ["tests/test_selfcheck.py::test_a_softcapped_head_is_judged_through_its_softcap"],
    ),
    "a_run_writes_inside_another_set": (
        "recipe/main.py",
        "    inside = set_around(out)  # a set's shards/ folder",
        "    inside = None  # a set's shards/ folder",
        ["tests/test_edges.py::test_no_command_writes_inside_another_set_reached_through_a_link"],
    ),
    "a_merge_writes_inside_another_set": (
        "recipe/shards/merge.py",
        "    inside = set_around(out)\n    if inside is not None:\n        raise MergeError",
        "    inside = None\n    if inside is not None:\n        raise MergeError",
        ["tests/test_edges.py::test_no_command_writes_inside_another_set_reached_through_a_link"],
    ),
    "vocab_map_writes_inside_another_set": (
        "recipe/shards/vocabmap.py",
        "    if inside is not None and not own:",
        "    if False:",
        ["tests/test_edges.py::test_no_command_writes_inside_another_set_reached_through_a_link"],
    ),
    "fp8_error_of_the_last_run_only": (
        "recipe/main.py",
        '        sums += np.asarray([before["error_sums"].get(s, [0.0, 0.0]) for s in job.slots]).T',
        "        pass",
        ["tests/test_fp8.py::test_after_a_resume_the_manifests_error_covers_the_whole_set"],
    ),
    "specforge_dataset_cuts_past_max_length": (
        "recipe/shards/trainers.py",
        "normalize_offline_sample(specforge_raw(self.sample(i), self.n_aux), self.max_len)",
        "normalize_offline_sample(specforge_raw(self.sample(i), self.n_aux), self.max_len + 8)",
        ["tests/test_export.py::test_specforge_reading_the_shards_truncates_as_it_does_its_own_files"],
    ),
    "a_checkpoint_states_two_rope_thetas": (
        "recipe/models/common.py",
        '        rope.update({k: real[k] for k in ("rope_theta", "partial_rotary_factor") if k in real and k in rope})',
        "        pass",
        ["tests/test_families.py::test_each_built_in_checkpoint_states_one_rope_base"],
    ),
    "framing_skips_the_frame_checksum": (
        "recipe/shards/framing.py",
        "    pos += 4 * checksum\n",
        "    pos += 0 * checksum\n",
        ["tests/test_edges.py::test_with_the_index_lost_repair_names_the_damaged_record"],
    ),
    "vocab_map_writes_through_a_link": (
        "recipe/shards/vocabmap.py",
        "    atomic_write(path, buf.getvalue())",
        "    path.write_bytes(buf.getvalue())",
        ["tests/test_edges.py::test_vocab_map_never_writes_through_a_link_left_in_its_folder"],
    ),
    "rebuild_index_writes_through_a_link": (
        "recipe/shards/__main__.py",
        "        atomic_write(dest, index_lines(recs))",
        "        dest.write_bytes(index_lines(recs))",
        ["tests/test_edges.py::test_rebuild_index_never_writes_through_a_link"],
    ),
    "early_stop_never_trips": (
        "recipe/packer/early.py",
        "if len(self.first) == self.n and reason is not None and set(self.first) == {reason}:",
        "if False:",
        ["tests/test_sglang_backend.py::test_a_systematic_failure_stops_the_run_early_naming_what_was_seen"],
    ),
    "early_stop_verdict_ignored": (
        "recipe/main.py",
        "        if early.verdict is not None:\n            raise early.verdict",
        "        if False:\n            raise early.verdict",
        ["tests/test_sglang_backend.py::test_a_systematic_failure_stops_the_run_early_naming_what_was_seen"],
    ),
    "self_check_judges_each_sample_by_the_firsts_rows": (
        "recipe/selfcheck.py",
        "        diff, room = np.abs(lp[at : at + k] - want), limit[at : at + k]",
        "        diff, room = np.abs(lp[:k] - want), limit[at : at + k]",
        ["tests/test_selfcheck.py::test_samples_judged_together_each_get_their_own_verdict"],
    ),
}


# What CI runs (`--fast`, about 3 minutes on 2 cores): the store's and the input's guarantees, each
# mutation's tests in the fast group. The whole list runs by hand (about 45 minutes).
FAST = (
    "null_content_read_as_empty",
    "a_cut_zst_read_as_a_shorter_file",
    "export_overwrite_sees_only_its_top_folder",
    "export_into_another_sets_folder",
    "export_stages_under_a_fixed_name",
    "a_stray_shards_records_indexed",
    "repair_cuts_through_a_hard_link",
    "merge_links_only_shard_named_files",
    "repair_keeps_edited_token_counts",
    "cut_without_its_margin",
    "empty_assistant_turns_accepted",
    "duplicates_count_as_invalid",
    "resume_checks_only_a_shards_first_record",
    "speculators_pre_norm_slot_in_float32",
    "identity_without_overflow",
    "reap_ignores_the_start_time",
    "one_restart_too_many",
    "layer_equal_to_depth_accepted",
    "atomic_replace_without_its_folders_fsync",
    "export_over_its_own_set",
    "merge_replaces_a_file_in_its_output",
    "reader_serves_a_shortened_index",
    "resume_stops_reading_a_shard_at_its_first_damage",
    "fp16_stored_as_bf16",
    "writes_through_a_linked_folder",
    "open_array_read_as_lines",
    "lost_identity_checks_the_old_keys_only",
    "reader_trusts_an_edited_manifest_capture",
    "index_line_shapes_unchecked",
    "bulk_line_judge_trusts_the_places",
    "edited_key_not_settled",
    "merge_accepts_a_damaged_input",
    "tool_calls_dropped_by_the_template",
    "resume_cuts_what_it_cannot_prove",
    "resume_indexes_a_damaged_copy",
    "resume_cuts_whole_records_the_index_lost",
    "resume_trusts_the_index_place",
    "resume_keeps_duplicate_lines",
    "deep_check_skips_the_crc",
    "tail_not_truncated",
    "identity_not_checked",
    "damaged_next_trusted",
    "merge_ignores_the_tokenizer",
)


def build_c(paths) -> None:
    """A mutated C source is rebuilt in place, as `pip install -e .` builds it (pyproject's ext-modules)."""
    import sysconfig

    for path in paths:
        if path.suffix == ".c":
            out = path.with_name(path.stem + ".abi3.so")
            inc = sysconfig.get_paths()["include"]
            subprocess.run(["cc", "-O3", "-shared", "-fPIC", f"-I{inc}", str(path), "-o", str(out)], check=True)


def mutated(name: str) -> tuple[dict[Path, str], dict[Path, str]]:
    """(originals, mutated texts) of the files the mutation changes, nothing written. `file` may be
    a tuple, one file per snippet, for a bug made on two sides at once."""
    rel, old, new, _ = MUTATIONS[name]
    old, new = (old, new) if isinstance(old, tuple) else ((old,), (new,))
    rels = rel if isinstance(rel, tuple) else (rel,) * len(old)
    originals, texts = {}, {}
    for r, o, n in zip(rels, old, new):
        path = ROOT / r
        if path not in texts:
            originals[path] = texts[path] = path.read_text()
        if texts[path].count(o) != 1:
            raise SystemExit(f"{name}: a snippet occurs {texts[path].count(o)} times in {r}; update tests/mutate.py")
        texts[path] = texts[path].replace(o, n)
    return originals, texts


def apply(name: str) -> dict[Path, str]:
    """Puts the mutation in; returns the originals of the files it changed."""
    originals, texts = mutated(name)
    for path, text in texts.items():
        path.write_text(text)
    build_c(texts)
    return originals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--fast", action="store_true", help="the subset CI runs (FAST)")
    a = ap.parse_args()
    names = a.names or (list(FAST) if a.fast else list(MUTATIONS))
    if a.list:
        for n in names:
            print(f"{n:34s} {MUTATIONS[n][0]}  ->  {' '.join(MUTATIONS[n][3])}")
        return 0
    unknown = sorted(set(names) - set(MUTATIONS))
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; --list shows them")
    for n in names:  # every snippet still where it was, before a long run stops halfway on one
        mutated(n)
    survived = []
    for n in names:
        originals = apply(n)
        t0 = time.monotonic()
        try:
            r = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "", *MUTATIONS[n][3]],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
        finally:
            for path, text in originals.items():
                path.write_text(text)
            build_c(originals)
        # caught: pytest ran and a test failed (or errored). A pytest that never ran (no pytest in
        # this Python, a bad path) is no catch: it would make every mutation look caught.
        ran = re.search(r"\d+ (failed|errors?)\b", r.stdout) is not None
        caught = r.returncode in (1, 2) and ran
        word = "caught  " if caught else ("SURVIVED" if r.returncode in (0, 5) else "NO RUN  ")
        print(f"{word} {n:34s} {time.monotonic() - t0:6.1f} s", flush=True)
        if word == "NO RUN  ":
            print((r.stdout + r.stderr)[-400:], flush=True)
        if not caught:
            survived.append(n)
    print(f"{len(names) - len(survived)} caught, {len(survived)} survived" + (f": {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
