//! Token-level stop decisions.

use crate::sampling::{check_token_stop, FinishReason, SamplingParams, StopReason};

#[test]
fn eos_stop_tokens_and_length() {
    let p = SamplingParams {
        min_tokens: 2,
        max_tokens: 5,
        stop_token_ids: vec![9],
        ..Default::default()
    };
    let eos = Some(0);
    assert_eq!(
        check_token_stop(0, 1, &p, eos),
        None,
        "EOS before min_tokens"
    );
    assert_eq!(
        check_token_stop(9, 1, &p, eos),
        None,
        "stop token before min_tokens"
    );
    assert_eq!(
        check_token_stop(0, 2, &p, eos),
        Some(FinishReason::Stop(StopReason::Eos))
    );
    assert_eq!(
        check_token_stop(9, 3, &p, eos),
        Some(FinishReason::Stop(StopReason::StopToken(9)))
    );
    assert_eq!(check_token_stop(4, 4, &p, eos), None);
    assert_eq!(check_token_stop(4, 5, &p, eos), Some(FinishReason::Length));
    assert_eq!(
        check_token_stop(0, 5, &p, eos),
        Some(FinishReason::Stop(StopReason::Eos))
    );
    assert_eq!(FinishReason::Length.as_str(), "length");
    assert_eq!(FinishReason::Stop(StopReason::Eos).as_str(), "stop");

    let ignore = SamplingParams {
        ignore_eos: true,
        ..p
    };
    assert_eq!(check_token_stop(0, 3, &ignore, eos), None);
    assert_eq!(
        check_token_stop(0, 3, &SamplingParams::default(), None),
        None
    );
}
