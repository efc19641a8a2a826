//! StopChecker against hand-worked cases and a char-by-char reference.

use proptest::prelude::*;

use crate::sampling::{StopChecker, StopUpdate};

/// Pushes `deltas` and returns each step's update.
fn run(stops: &[&str], include: bool, deltas: &[&str]) -> (Vec<StopUpdate>, StopChecker) {
    let mut c = StopChecker::new(stops.iter().map(|s| s.to_string()).collect(), include, 0);
    let ups = deltas.iter().map(|d| c.push(d)).collect();
    (ups, c)
}

fn up(text: &str, stop: Option<&str>) -> StopUpdate {
    StopUpdate {
        text: text.into(),
        stop: stop.map(Into::into),
    }
}

#[test]
fn stop_string_spanning_deltas_is_held_back_then_cut() {
    let (ups, c) = run(&["STOP"], false, &["Hello S", "TO", "P world"]);
    assert_eq!(
        ups,
        vec![up("Hello ", None), up("", None), up("", Some("STOP"))]
    );
    assert!(c.is_stopped());
}

#[test]
fn include_stop_str_keeps_it_and_emits_without_delay() {
    let (ups, _) = run(&["STOP"], true, &["Hello S", "TO", "P world"]);
    assert_eq!(
        ups,
        vec![up("Hello S", None), up("TO", None), up("P", Some("STOP"))]
    );
}

#[test]
fn stop_at_the_very_start() {
    let (ups, _) = run(&["Hi"], false, &["Hi there"]);
    assert_eq!(ups, vec![up("", Some("Hi"))]);
    let (ups, _) = run(&["Hi"], true, &["Hi there"]);
    assert_eq!(ups, vec![up("Hi", Some("Hi"))]);
}

#[test]
fn overlapping_candidates_first_to_complete_wins() {
    // "bc" completes before "abcd" does, whatever the list order.
    let (ups, _) = run(&["abcd", "bc"], false, &["xabcd"]);
    assert_eq!(ups, vec![up("xa", Some("bc"))]);
    // Equal ends: the longer (earlier-starting) one.
    let (ups, _) = run(&["bc", "abc"], false, &["xabc"]);
    assert_eq!(ups, vec![up("x", Some("abc"))]);
}

#[test]
fn failed_partial_match_releases_only_what_cannot_match() {
    let (ups, _) = run(&["aab"], false, &["a", "a", "a", "b"]);
    assert_eq!(
        ups,
        vec![
            up("", None),
            up("", None),
            up("a", None),
            up("", Some("aab"))
        ]
    );
}

#[test]
fn multibyte_text_is_held_on_char_boundaries() {
    let (ups, mut c) = run(&["é!"], false, &["café", " ok"]);
    assert_eq!(ups, vec![up("caf", None), up("é ok", None)]);
    assert_eq!(c.finish(), "");
    let (ups, _) = run(&["é!"], false, &["café", "!"]);
    assert_eq!(ups, vec![up("caf", None), up("", Some("é!"))]);
}

#[test]
fn finish_releases_held_text_and_pushes_after_stop_are_ignored() {
    let (_, mut c) = run(&["END"], false, &["the E", "N"]);
    assert_eq!(c.pending(), "EN");
    assert_eq!(c.finish(), "EN");
    let (_, mut c) = run(&["x"], false, &["ax"]);
    assert_eq!(c.push("more"), StopUpdate::default());
}

#[test]
fn stop_strings_ignored_until_min_tokens() {
    let mut c = StopChecker::new(vec!["x".into()], false, 2);
    assert_eq!(c.push("x"), up("x", None));
    assert_eq!(c.push("ax"), up("ax", None));
    assert_eq!(c.push("bxc"), up("b", Some("x")));
}

/// Reference: the first byte position where, reading char by char, some stop
/// string has just been completed; ties go to the longest such stop string.
/// Only matches ending after byte `armed_from` count. Returns (start, end).
fn reference_match(text: &str, stops: &[String], armed_from: usize) -> Option<(usize, usize)> {
    let ends = text
        .char_indices()
        .map(|(i, c)| i + c.len_utf8())
        .filter(|&e| e > armed_from);
    for end in ends {
        let longest = stops
            .iter()
            .filter(|s| text[..end].ends_with(s.as_str()))
            .map(|s| s.len())
            .max();
        if let Some(len) = longest {
            return Some((end - len, end));
        }
    }
    None
}

proptest! {
    #[test]
    fn emitted_plus_pending_is_the_input_up_to_the_stop(
        text in "[abé]{0,30}",
        stops in prop::collection::vec("[abé]{1,4}", 1..4),
        cuts in prop::collection::vec(0usize..40, 0..12),
        include in any::<bool>(),
        min_tokens in 0usize..4,
    ) {
        // Split at char boundaries chosen by `cuts`.
        let chars: Vec<char> = text.chars().collect();
        let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(chars.len())).collect();
        points.push(0);
        points.push(chars.len());
        points.sort_unstable();
        let deltas: Vec<String> = points
            .windows(2)
            .map(|w| chars[w[0]..w[1]].iter().collect())
            .collect();
        let armed_from: usize = deltas.iter().take(min_tokens).map(|d| d.len()).sum();

        let mut c = StopChecker::new(stops.clone(), include, min_tokens);
        let (mut emitted, mut pushed, mut matched) = (String::new(), String::new(), None);
        for d in &deltas {
            let u = c.push(d);
            emitted.push_str(&u.text);
            pushed.push_str(d);
            if u.stop.is_some() {
                matched = u.stop;
                break;
            }
            prop_assert_eq!(format!("{}{}", emitted, c.pending()), pushed.clone());
        }
        match reference_match(&text, &stops, armed_from) {
            Some((start, end)) => {
                let stop = matched.expect("reference found a stop string");
                prop_assert_eq!(&text[start..end], stop.as_str());
                prop_assert_eq!(emitted, text[..if include { end } else { start }].to_string());
            }
            None => {
                prop_assert_eq!(matched, None);
                emitted.push_str(&c.finish());
                prop_assert_eq!(emitted, text);
            }
        }
    }
}
