//! Request validation's unit tests: typed fields, sampling parameters,
//! prompts and chat messages.

use super::*;
use crate::server::protocol::{ChatCompletionRequest, CompletionRequest};
use serde_json::json;

fn sampling(body: Value) -> Result<SamplingParams, ApiError> {
    sampling_params(&typed::<SamplingRequest>(&body)?, None, 16, &NO_WORDS)
}

#[test]
fn wrong_types_name_the_field() {
    let e = typed::<SamplingRequest>(&json!({"max_tokens": "ten"})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e:?}");
    let e = typed::<SamplingRequest>(&json!({"max_tokens": -1})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e:?}");
    let e = typed::<ChatCompletionRequest>(&json!({"messages": [{"content": "hi"}]})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages[0]"), "{e:?}");
    assert!(e.message.contains("role"), "{e:?}");
    let e = typed::<CompletionRequest>(&json!({"model": "m"})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("prompt"), "{e:?}");
}

#[test]
fn out_of_range_values_name_the_field() {
    for (body, field) in [
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"temperature": -0.5}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"presence_penalty": 3.0}), "presence_penalty"),
        (json!({"frequency_penalty": -2.5}), "frequency_penalty"),
        (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
        (json!({"n": 0}), "n"),
        (json!({"stop": ["", "x"]}), "stop"),
    ] {
        let e = sampling(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(field), "{body}: {e:?}");
        assert!(
            e.message.starts_with(&format!("`{field}`")),
            "{body}: {e:?}"
        );
    }
    let e = sampling_params(&SamplingRequest::default(), Some(21), 16, &NO_WORDS).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("logprobs"));
}

#[test]
fn fields_reach_sampling_params() {
    let p = sampling(json!({
            "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "max_tokens": 9,
            "stop": "END", "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
            "extra_args": {"a": 1}, "vllm_xargs": {"b": 2}, "ignore_eos": true, "min_tokens": 2,
        }))
        .unwrap();
    assert_eq!(
        (p.temperature, p.top_p, p.top_k, p.min_p),
        (0.5, 0.9, 5, 0.1)
    );
    assert_eq!((p.seed, p.max_tokens, p.min_tokens), (Some(7), 9, 2));
    assert_eq!(p.stop, vec!["END".to_string()]);
    assert_eq!(
        (
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty
        ),
        (0.5, 0.25, 1.1)
    );
    assert_eq!(p.extra_args, Some(json!({"a": 1, "b": 2})));
    assert!(p.ignore_eos);
    // max_completion_tokens wins; the default applies when neither is set.
    assert_eq!(
        sampling(json!({"max_tokens": 3, "max_completion_tokens": 4}))
            .unwrap()
            .max_tokens,
        4
    );
    assert_eq!(sampling(json!({})).unwrap().max_tokens, 16);
}

#[test]
fn logit_bias_keys_are_decimal_token_ids_below_the_vocabulary() {
    let p = sampling(json!({"logit_bias": {"7": -100, "5": 1.5, "99": 100}})).unwrap();
    let mut bias = p.logit_bias.clone();
    bias.sort_by_key(|&(t, _)| t);
    assert_eq!(bias, vec![(5, 1.5), (7, -100.0), (99, 100.0)]);
    for key in ["abc", "05", "+5", "-1", "", "4294967296", "1.0"] {
        let e = sampling(json!({"logit_bias": {key: 1}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"), "{key}: {e:?}");
        assert!(e.message.contains("not a token id"), "{key}: {e:?}");
    }
    let e = sampling(json!({"logit_bias": {"100": 1}})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("logit_bias"));
    assert_eq!(
        e.message,
        "`logit_bias`: must be keyed by token ids below the vocabulary size 100, got 100"
    );
    for bias in [json!(101), json!(-100.5), json!(1e300)] {
        let e = sampling(json!({"logit_bias": {"3": bias}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"), "{e:?}");
        assert!(e.message.contains("[-100, 100]"), "{e:?}");
    }
    let e = sampling(json!({"logit_bias": {"3": "high"}})).unwrap_err();
    assert!(e.param.unwrap().starts_with("logit_bias"));
}

#[test]
fn allowed_token_ids_are_non_empty_and_below_the_vocabulary() {
    let p = sampling(json!({"allowed_token_ids": [3, 99, 3]})).unwrap();
    assert_eq!(p.allowed_token_ids, Some(vec![3, 99, 3]));
    assert_eq!(sampling(json!({})).unwrap().allowed_token_ids, None);
    for (ids, says) in [
        (json!([]), "non-empty"),
        (json!([1, 100]), "below the vocabulary size 100, got 100"),
    ] {
        let e = sampling(json!({ "allowed_token_ids": ids })).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("allowed_token_ids"), "{e:?}");
        assert!(e.message.contains(says), "{e:?}");
    }
    let e = sampling(json!({"allowed_token_ids": [-1]})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("allowed_token_ids[0]"));
}

/// vLLM's rule: the word as it starts the text, and after a space when
/// that spelling starts with another token and is as long.
#[test]
fn bad_words_are_tokenized_as_vllm_does() {
    const WORDS: Words = Words(&[
        ("hello", &[10]),
        (" hello", &[11]),
        ("New York", &[20, 21]),
        (" New York", &[22, 21]),
        ("xyz", &[30, 31]),
        (" xyz", &[32, 30, 31]),
        ("same", &[40]),
        (" same", &[40]),
        ("big", &[150]),
        (" big", &[151]),
    ]);
    let words = |w: Value| {
        sampling_params(
            &typed::<SamplingRequest>(&json!({ "bad_words": w })).unwrap(),
            None,
            16,
            &WORDS,
        )
    };
    let p = words(json!(["hello", "  New York", "xyz", "same"])).unwrap();
    assert_eq!(
        p.bad_words_token_ids,
        vec![
            vec![10],
            vec![11],
            vec![20, 21],
            vec![22, 21],
            vec![30, 31],
            vec![40]
        ]
    );
    for (w, param, says) in [
        (json!(["hello", ""]), "bad_words[1]", "is empty"),
        (json!(["  "]), "bad_words[0]", "is empty"),
        (json!(["unknown"]), "bad_words[0]", "no ids for \"unknown\""),
        (
            json!(["big"]),
            "bad_words",
            "below the vocabulary size 100, got 150",
        ),
    ] {
        let e = words(w.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{w}: {e:?}");
        assert!(e.message.contains(says), "{w}: {e:?}");
    }
}

#[test]
fn prompts_are_classified() {
    assert_eq!(
        prompts_of(&json!("hi")).unwrap(),
        vec![PromptInput::Text("hi".into())]
    );
    assert_eq!(prompts_of(&json!(["a", "b"])).unwrap().len(), 2);
    assert_eq!(
        prompts_of(&json!([1, 2, 3])).unwrap(),
        vec![PromptInput::Tokens(vec![1, 2, 3])]
    );
    assert_eq!(prompts_of(&json!([[1], [2, 3]])).unwrap().len(), 2);
    for bad in [
        json!(5),
        json!([]),
        json!(["a", 1]),
        json!([1, -2]),
        json!([[1], "x"]),
        json!({"a": 1}),
    ] {
        assert_eq!(
            prompts_of(&bad).unwrap_err().param.as_deref(),
            Some("prompt"),
            "{bad}"
        );
    }
}

#[test]
fn chat_content_parts_are_joined_or_refused() {
    let req: ChatCompletionRequest = typed(&json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": null},
    ]}))
    .unwrap();
    let msgs = chat_messages(&req.messages).unwrap();
    assert_eq!(
        msgs,
        vec![
            ChatMessage::new("user", "ab"),
            ChatMessage::new("assistant", "")
        ]
    );
    let req: ChatCompletionRequest =
        typed(&json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
            .unwrap();
    let e = chat_messages(&req.messages).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
    assert_eq!(
        chat_messages(&[]).unwrap_err().param.as_deref(),
        Some("messages")
    );
}

#[test]
fn roles_are_checked_and_developer_is_system() {
    let msgs = |role: &str| {
        let req: ChatCompletionRequest =
                typed(&json!({"messages": [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]}))
                    .unwrap();
        chat_messages(&req.messages)
    };
    for role in ["system", "user", "assistant"] {
        assert_eq!(msgs(role).unwrap()[1], ChatMessage::new(role, "b"));
    }
    assert_eq!(
        msgs("developer").unwrap()[1],
        ChatMessage::new("system", "b")
    );
    // A tool result is a user turn naming the call it answers.
    assert_eq!(
        msgs("tool").unwrap()[1],
        ChatMessage::new("user", "Result of the function call:\nb")
    );
    for role in ["bot", "function", "System", ""] {
        let e = msgs(role).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].role"), "{role}");
        assert!(
            e.message.contains("system") || e.message.contains("tool"),
            "{e:?}"
        );
    }
    assert!(msgs("bot")
        .unwrap_err()
        .message
        .contains("system, developer (taken as system), user, assistant and tool"));
}

#[test]
fn seeds_take_every_64_bit_integer_signed_or_not() {
    let seed = |v: Value| sampling(json!({ "seed": v })).map(|p| p.seed);
    assert_eq!(seed(json!(7)).unwrap(), Some(7));
    assert_eq!(seed(json!(u64::MAX)).unwrap(), Some(u64::MAX));
    assert_eq!(seed(Value::Null).unwrap(), None);
    // Negative seeds (vLLM's range reaches -2^63) are keys of their own.
    let (minus_one, min) = (seed(json!(-1)).unwrap(), seed(json!(i64::MIN)).unwrap());
    assert!(minus_one.is_some() && min.is_some() && minus_one != min);
    assert_ne!(minus_one, seed(json!(1)).unwrap());
    for bad in [json!(1.5), json!("7"), json!(1e30)] {
        let e = seed(bad.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("seed"), "{bad}");
        assert!(e.message.contains("integer"), "{bad}: {}", e.message);
    }
}

#[test]
fn truncation_keeps_the_prompts_last_tokens_as_vllm_reads_the_field() {
    let keep = |v: Value| {
        let req = typed::<SamplingRequest>(&json!({ "truncate_prompt_tokens": v }))?;
        truncation(&req, 100)
    };
    assert_eq!(keep(Value::Null).unwrap(), None);
    assert_eq!(keep(json!(3)).unwrap(), Some(3));
    assert_eq!(keep(json!(100)).unwrap(), Some(100));
    assert_eq!(keep(json!(-1)).unwrap(), Some(100), "-1 is the context");
    for (bad, says) in [
        (json!(0), "at least 1"),
        (json!(-2), "at least 1"),
        (json!(101), "at most 100"),
        (json!(i64::MAX), "at most 100"),
        (json!("3"), "truncate_prompt_tokens"),
    ] {
        let e = keep(bad.clone()).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("truncate_prompt_tokens"),
            "{bad}: {e:?}"
        );
        assert!(e.message.contains(says), "{bad}: {e:?}");
    }
    let mut prompt = vec![1, 2, 3, 4, 5];
    assert!(truncate_prompt(&mut prompt, Some(2)));
    assert_eq!(prompt, [4, 5]);
    assert!(!truncate_prompt(&mut prompt, Some(2)));
    assert!(!truncate_prompt(&mut prompt, Some(9)));
    assert!(!truncate_prompt(&mut prompt, None));
    assert_eq!(prompt, [4, 5]);
}

#[test]
fn the_last_message_is_left_open_after_its_text() {
    let text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon<|im_end|>\n";
    let end = open_end(text, "Once upon").unwrap();
    assert_eq!(
        &text[..end],
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"
    );
    // Trailing whitespace the template stripped is not asked for.
    let end = open_end(text, "Once upon  ").unwrap();
    assert!(text[..end].ends_with("Once upon"));
    // The last occurrence is the final message's.
    let text = "a\nhi\nb\nhi\nc";
    assert_eq!(open_end(text, "hi"), Some(9));
    assert_eq!(open_end(text, ""), None);
    assert_eq!(open_end(text, "absent"), None);
}

#[test]
fn documents_are_a_template_variable_unless_the_kwargs_set_one() {
    let documents =
        [json!({"title": "Tides", "text": "Twice a day."})].map(|d| d.as_object().unwrap().clone());
    fn rendering<'a>(
        kwargs: Option<&'a TemplateKwargs>,
        documents: &'a [Map<String, Value>],
    ) -> ChatRendering<'a> {
        ChatRendering {
            add_generation_prompt: true,
            continue_final_message: false,
            kwargs,
            documents: Some(documents),
            add_special_tokens: false,
        }
    }
    let variables = rendering(None, &documents).variables().unwrap();
    assert_eq!(
        Value::Object(variables.into_owned()),
        json!({"documents": [{"title": "Tides", "text": "Twice a day."}]})
    );
    let kwargs = json!({"documents": [], "enable_thinking": false});
    let kwargs = kwargs.as_object().unwrap();
    let variables = rendering(Some(kwargs), &documents).variables().unwrap();
    assert_eq!(&*variables, kwargs, "the kwargs win, as in vLLM");
    let reserved = json!({"messages": []});
    let e = rendering(reserved.as_object(), &documents)
        .variables()
        .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("chat_template_kwargs.messages"));
}
