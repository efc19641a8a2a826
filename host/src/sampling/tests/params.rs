//! Defaults, (de)serialisation and the validation boundary of every field.

use crate::sampling::{SamplingParams, SamplingParamsError};

/// Default params with one change, validated.
fn check(f: impl FnOnce(&mut SamplingParams)) -> Result<(), SamplingParamsError> {
    let mut p = SamplingParams::default();
    f(&mut p);
    p.validate()
}

/// Asserts the error names `field` and the offending value.
fn rejects(field: &str, f: impl FnOnce(&mut SamplingParams)) {
    let err = check(f).expect_err(field).to_string();
    assert!(err.starts_with(&format!("{field} must be ")), "{err}");
    assert!(err.contains(", got "), "{err}");
}

#[test]
fn defaults_are_vllms() {
    let p = SamplingParams::default();
    assert_eq!(p.n, 1);
    assert_eq!(p.temperature, 1.0);
    assert_eq!(p.top_p, 1.0);
    assert_eq!(p.top_k, 0);
    assert_eq!(p.min_p, 0.0);
    assert_eq!(p.presence_penalty, 0.0);
    assert_eq!(p.frequency_penalty, 0.0);
    assert_eq!(p.repetition_penalty, 1.0);
    assert_eq!(p.seed, None);
    assert_eq!(p.max_tokens, 16);
    assert_eq!(p.min_tokens, 0);
    assert!(p.stop.is_empty() && p.stop_token_ids.is_empty());
    assert!(!p.ignore_eos && !p.include_stop_str_in_output);
    assert_eq!(p.logprobs, None);
    assert!(p.skip_special_tokens);
    assert_eq!(p.extra_args, None);
    assert_eq!(p.validate(), Ok(()));
}

#[test]
fn json_fills_defaults_and_rejects_unknown_fields() {
    let p: SamplingParams =
        serde_json::from_str(r#"{"temperature": 0, "stop": ["\n"], "seed": 7}"#).unwrap();
    assert_eq!(p.temperature, 0.0);
    assert_eq!(p.stop, vec!["\n".to_string()]);
    assert_eq!(p.seed, Some(7));
    assert_eq!(p.max_tokens, 16);
    let err = serde_json::from_str::<SamplingParams>(r#"{"top_pp": 0.5}"#).unwrap_err();
    assert!(err.to_string().contains("top_pp"), "{err}");
}

#[test]
fn toml_round_trip() {
    let p: SamplingParams =
        toml::from_str("top_k = 40\nextra_args = { plugin = \"x\" }\n").unwrap();
    assert_eq!(p.top_k, 40);
    assert_eq!(p.extra_args, Some(serde_json::json!({"plugin": "x"})));
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(serde_json::from_str::<SamplingParams>(&json).unwrap(), p);
}

#[test]
fn error_message_names_field_value_and_range() {
    let err = check(|p| p.top_p = 1.5).unwrap_err();
    assert_eq!(err.to_string(), "top_p must be in (0, 1], got 1.5");
    let err = check(|p| {
        p.max_tokens = 4;
        p.min_tokens = 5
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "min_tokens must be <= max_tokens (4), got 5"
    );
}

#[test]
fn n_boundary() {
    rejects("n", |p| p.n = 0);
    assert!(check(|p| p.n = 1).is_ok());
}

#[test]
fn temperature_boundary() {
    assert!(check(|p| p.temperature = 0.0).is_ok());
    assert!(check(|p| p.temperature = 100.0).is_ok());
    rejects("temperature", |p| p.temperature = -1e-6);
    rejects("temperature", |p| p.temperature = f32::NAN);
    rejects("temperature", |p| p.temperature = f32::INFINITY);
}

#[test]
fn top_p_boundary() {
    assert!(check(|p| p.top_p = 1.0).is_ok());
    assert!(check(|p| p.top_p = 1e-6).is_ok());
    rejects("top_p", |p| p.top_p = 0.0);
    rejects("top_p", |p| p.top_p = 1.0001);
    rejects("top_p", |p| p.top_p = f32::NAN);
}

#[test]
fn top_k_boundary() {
    for k in [-1, 0, 1, 50] {
        assert!(check(|p| p.top_k = k).is_ok(), "{k}");
    }
    rejects("top_k", |p| p.top_k = -2);
    let p = SamplingParams {
        top_k: 50,
        ..Default::default()
    };
    assert_eq!(p.effective_top_k(100), Some(50));
    assert_eq!(p.effective_top_k(50), None);
    let p = SamplingParams {
        top_k: -1,
        ..Default::default()
    };
    assert_eq!(p.effective_top_k(100), None);
}

#[test]
fn min_p_boundary() {
    assert!(check(|p| p.min_p = 0.0).is_ok());
    assert!(check(|p| p.min_p = 1.0).is_ok());
    rejects("min_p", |p| p.min_p = -0.01);
    rejects("min_p", |p| p.min_p = 1.01);
    rejects("min_p", |p| p.min_p = f32::NAN);
}

#[test]
fn presence_and_frequency_penalty_boundaries() {
    for v in [-2.0, 0.0, 2.0] {
        assert!(check(|p| p.presence_penalty = v).is_ok());
        assert!(check(|p| p.frequency_penalty = v).is_ok());
    }
    for v in [-2.01, 2.01, f32::NAN] {
        rejects("presence_penalty", |p| p.presence_penalty = v);
        rejects("frequency_penalty", |p| p.frequency_penalty = v);
    }
}

#[test]
fn repetition_penalty_boundary() {
    assert!(check(|p| p.repetition_penalty = 1e-3).is_ok());
    assert!(check(|p| p.repetition_penalty = 5.0).is_ok());
    rejects("repetition_penalty", |p| p.repetition_penalty = 0.0);
    rejects("repetition_penalty", |p| p.repetition_penalty = -1.0);
    rejects("repetition_penalty", |p| {
        p.repetition_penalty = f32::INFINITY
    });
    rejects("repetition_penalty", |p| p.repetition_penalty = f32::NAN);
}

#[test]
fn max_and_min_tokens_boundaries() {
    rejects("max_tokens", |p| p.max_tokens = 0);
    assert!(check(|p| p.max_tokens = 1).is_ok());
    assert!(check(|p| p.min_tokens = 16).is_ok());
    rejects("min_tokens", |p| p.min_tokens = 17);
}

#[test]
fn logprobs_boundary() {
    assert!(check(|p| p.logprobs = Some(0)).is_ok());
    assert!(check(|p| p.logprobs = Some(20)).is_ok());
    rejects("logprobs", |p| p.logprobs = Some(21));
    assert!(check(|p| p.prompt_logprobs = Some(0)).is_ok());
    assert!(check(|p| p.prompt_logprobs = Some(20)).is_ok());
    rejects("prompt_logprobs", |p| p.prompt_logprobs = Some(21));
}

#[test]
fn empty_stop_string_rejected() {
    assert!(check(|p| p.stop = vec!["a".into()]).is_ok());
    rejects("stop", |p| p.stop = vec!["a".into(), String::new()]);
}

#[test]
fn greedy_threshold() {
    let greedy = |t| {
        SamplingParams {
            temperature: t,
            ..Default::default()
        }
        .is_greedy()
    };
    assert!(greedy(0.0));
    assert!(greedy(9e-6));
    assert!(!greedy(1e-4));
}

#[test]
fn extra_args_cross_json_and_the_binary_queue_format_unchanged() {
    let p = SamplingParams {
        extra_args: Some(serde_json::json!({"banned": [1, 2], "bias": {"7": -1.5}, "name": "x"})),
        ..Default::default()
    };
    let bytes = postcard::to_stdvec(&p).unwrap();
    assert_eq!(postcard::from_bytes::<SamplingParams>(&bytes).unwrap(), p);
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(
        json["extra_args"]["bias"]["7"], -1.5,
        "JSON keeps the value's own shape"
    );
    assert_eq!(serde_json::from_value::<SamplingParams>(json).unwrap(), p);
    let none = SamplingParams::default();
    assert_eq!(
        postcard::from_bytes::<SamplingParams>(&postcard::to_stdvec(&none).unwrap()).unwrap(),
        none
    );
}

#[test]
fn logit_bias_range_is_openais() {
    assert!(check(|p| p.logit_bias = vec![(1, -100.0), (2, 100.0), (3, 0.5)]).is_ok());
    for bad in [100.5, -101.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        rejects("logit_bias", |p| p.logit_bias = vec![(1, 0.0), (7, bad)]);
    }
    let err = check(|p| p.logit_bias = vec![(7, 101.0)]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "logit_bias must be in [-100, 100] (the bias of token 7), got 101.0"
    );
}

#[test]
fn allowed_token_ids_must_not_be_empty() {
    assert!(check(|p| p.allowed_token_ids = Some(vec![0])).is_ok());
    rejects("allowed_token_ids", |p| p.allowed_token_ids = Some(vec![]));
    rejects("allowed_token_ids", |p| {
        p.allowed_token_ids = Some(vec![0; crate::sampling::MAX_TOKEN_ID_LIST + 1])
    });
}

#[test]
fn bad_words_are_non_empty_and_bounded() {
    use crate::sampling::{MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS};
    assert!(check(|p| p.bad_words_token_ids = vec![vec![1], vec![2, 3]]).is_ok());
    rejects("bad_words", |p| {
        p.bad_words_token_ids = vec![vec![1], vec![]]
    });
    let many = vec![vec![1]; MAX_BAD_WORD_SEQUENCES];
    assert!(check(|p| p.bad_words_token_ids = many.clone()).is_ok());
    rejects("bad_words", |p| {
        p.bad_words_token_ids = vec![vec![1]; MAX_BAD_WORD_SEQUENCES + 1]
    });
    // Two sequences of half the token budget fit; one more token does not.
    let half = vec![5; MAX_BAD_WORD_TOKENS / 2];
    assert!(check(|p| p.bad_words_token_ids = vec![half.clone(), half.clone()]).is_ok());
    let err = check(|p| p.bad_words_token_ids = vec![half.clone(), half.clone(), vec![1]])
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("bad_words must be at most 1024 tokens"),
        "{err}"
    );
    assert!(err.ends_with("got 1025"), "{err}");
}

#[test]
fn check_vocab_names_the_field_and_the_first_id_outside() {
    let p = SamplingParams {
        logit_bias: vec![(3, 1.0), (9, 1.0)],
        allowed_token_ids: Some(vec![0, 9]),
        bad_words_token_ids: vec![vec![1, 9]],
        ..Default::default()
    };
    assert_eq!(p.check_vocab(10), Ok(()));
    let err = |p: &SamplingParams| p.check_vocab(9).unwrap_err().to_string();
    assert_eq!(
        err(&p),
        "logit_bias must be keyed by token ids below the vocabulary size 9, got 9"
    );
    let p = SamplingParams {
        logit_bias: vec![],
        ..p
    };
    assert_eq!(
        err(&p),
        "allowed_token_ids must be token ids below the vocabulary size 9, got 9"
    );
    let p = SamplingParams {
        allowed_token_ids: None,
        ..p
    };
    assert_eq!(
        err(&p),
        "bad_words must be tokenized into ids below the vocabulary size 9, got 9"
    );
}

/// The mp executor sends `SamplingParams` to its workers with postcard: the
/// new fields must arrive as they left.
#[test]
fn token_filters_cross_the_binary_queue_format_and_json() {
    let p = SamplingParams {
        logit_bias: vec![(5, -100.0), (49151, 2.5)],
        allowed_token_ids: Some(vec![1, 2, 3]),
        bad_words_token_ids: vec![vec![7], vec![8, 9, 10]],
        ..Default::default()
    };
    let bytes = postcard::to_stdvec(&p).unwrap();
    assert_eq!(postcard::from_bytes::<SamplingParams>(&bytes).unwrap(), p);
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(serde_json::from_str::<SamplingParams>(&json).unwrap(), p);
    // A JSONL line spells them as lists.
    let line: SamplingParams = serde_json::from_str(
        r#"{"logit_bias": [[5, -100]], "allowed_token_ids": [1], "bad_words_token_ids": [[7]]}"#,
    )
    .unwrap();
    assert_eq!(line.logit_bias, vec![(5, -100.0)]);
    assert_eq!(line.allowed_token_ids, Some(vec![1]));
    assert_eq!(line.bad_words_token_ids, vec![vec![7]]);
}

#[test]
fn children_get_distinct_reproducible_seeds() {
    let p = SamplingParams {
        n: 3,
        seed: Some(10),
        ..SamplingParams::default()
    };
    let seeds: Vec<_> = (0..3).map(|i| p.child(i).seed).collect();
    assert_eq!(seeds, vec![Some(10), Some(11), Some(12)]);
    assert_eq!(p.child(2).n, 1);
    let unseeded = SamplingParams {
        n: 2,
        ..SamplingParams::default()
    };
    assert_eq!(unseeded.child(1).seed, None);
}
