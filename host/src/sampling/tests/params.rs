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
