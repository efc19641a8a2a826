//! OpenAI's `truncation: "auto"`: a conversation longer than the context
//! loses its oldest items from the prompt until the prompt fits.

use super::super::error::ApiError;
use crate::tokenizer::ChatMessage;

/// The conversation without its `dropped` oldest items. System messages
/// stay (they are instructions, not turns), and a tool result whose call
/// was left out goes with it, unless it is the last message.
pub fn kept(conversation: &[ChatMessage], dropped: usize) -> impl Iterator<Item = &ChatMessage> {
    let last = conversation.len().saturating_sub(1);
    let mut left = dropped;
    let mut orphaned = false;
    conversation.iter().enumerate().filter_map(move |(i, m)| {
        if m.role == "system" {
            return Some(m);
        }
        if left > 0 {
            left -= 1;
            orphaned = true;
            return None;
        }
        if orphaned && m.role == "tool" && i < last {
            return None;
        }
        orphaned = false;
        Some(m)
    })
}

/// The prompt `render(dropped)` gives for the fewest oldest items dropped
/// that `fits`, the last item always kept; when even that does not fit,
/// that prompt, for the context check to refuse by its length. Fewer items
/// make a shorter prompt, so the search halves: a few renders even for a
/// conversation of `server.max_messages` items.
pub fn fitting(
    conversation: &[ChatMessage],
    render: impl Fn(usize) -> Result<Vec<u32>, ApiError>,
    fits: impl Fn(&[u32]) -> bool,
) -> Result<Vec<u32>, ApiError> {
    let whole = render(0)?;
    let items = conversation.iter().filter(|m| m.role != "system").count();
    if fits(&whole) || items < 2 {
        return Ok(whole);
    }
    let (mut lo, mut hi) = (1, items - 1);
    let mut best = render(hi)?;
    if !fits(&best) {
        return Ok(best);
    }
    // `hi` fits and `best` is its prompt; nothing below `lo` does.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let prompt = render(mid)?;
        if fits(&prompt) {
            hi = mid;
            best = prompt;
        } else {
            lo = mid + 1;
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation(roles: &[&str]) -> Vec<ChatMessage> {
        roles
            .iter()
            .enumerate()
            .map(|(i, &r)| ChatMessage::new(r, i.to_string()))
            .collect()
    }

    fn kept_of(c: &[ChatMessage], dropped: usize) -> Vec<String> {
        kept(c, dropped).map(|m| m.content.clone()).collect()
    }

    #[test]
    fn the_oldest_turns_go_first_and_instructions_stay() {
        let c = conversation(&["system", "user", "assistant", "user"]);
        assert_eq!(kept_of(&c, 0), ["0", "1", "2", "3"]);
        assert_eq!(kept_of(&c, 1), ["0", "2", "3"]);
        assert_eq!(kept_of(&c, 2), ["0", "3"]);
        // A call's results go with it; the last message always stays.
        let c = conversation(&["user", "assistant", "tool", "tool", "user"]);
        assert_eq!(kept_of(&c, 2), ["4"]);
        let c = conversation(&["user", "assistant", "tool"]);
        assert_eq!(kept_of(&c, 2), ["2"]);
    }

    /// Against a linear scan: the fewest items dropped that fit, whatever
    /// the limit, with one token per kept message.
    #[test]
    fn the_search_finds_the_fewest_items_to_drop() {
        let c = conversation(&["system", "user", "assistant", "user", "assistant", "user"]);
        let render = |dropped: usize| Ok(vec![0; kept(&c, dropped).count()]);
        for limit in 0..8 {
            let fits = |p: &[u32]| p.len() <= limit;
            let got = fitting(&c, render, fits).unwrap().len();
            let scan = (0..5)
                .map(|d| kept(&c, d).count())
                .find(|&n| n <= limit)
                .unwrap_or(2);
            assert_eq!(got, scan, "limit {limit}");
        }
    }
}
