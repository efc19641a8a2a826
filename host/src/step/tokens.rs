//! A request's tokens of one step, stored inline up to four: what a
//! worker sampled for it and what the scheduler hands the engine. A decode
//! step yields one token, a verified speculative step a few, so building a
//! step's outputs does not allocate per request.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Token ids stored inline up to four, spilling to the heap past that.
#[derive(Clone, Default)]
pub struct NewTokens {
    len: u32,
    inline: [u32; 4],
    spill: Vec<u32>,
}

impl NewTokens {
    /// Appends a token.
    pub fn push(&mut self, t: u32) {
        let n = self.len as usize;
        if n < self.inline.len() {
            self.inline[n] = t;
        } else {
            if n == self.inline.len() {
                self.spill.extend_from_slice(&self.inline);
            }
            self.spill.push(t);
        }
        self.len += 1;
    }

    /// The tokens.
    pub fn as_slice(&self) -> &[u32] {
        let n = self.len as usize;
        if n <= self.inline.len() {
            &self.inline[..n]
        } else {
            &self.spill
        }
    }
}

impl std::ops::Deref for NewTokens {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        self.as_slice()
    }
}

impl std::fmt::Debug for NewTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl PartialEq for NewTokens {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Serialize for NewTokens {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for NewTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let tokens = Vec::<u32>::deserialize(d)?;
        Ok(NewTokens::from(&tokens[..]))
    }
}

impl From<&[u32]> for NewTokens {
    fn from(tokens: &[u32]) -> NewTokens {
        let mut t = NewTokens::default();
        for &token in tokens {
            t.push(token);
        }
        t
    }
}

impl<const N: usize> From<[u32; N]> for NewTokens {
    fn from(tokens: [u32; N]) -> NewTokens {
        NewTokens::from(&tokens[..])
    }
}

impl AsRef<[u32]> for NewTokens {
    fn as_ref(&self) -> &[u32] {
        self.as_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_tokens_spill_past_inline_capacity() {
        let mut t = NewTokens::default();
        assert!(t.is_empty());
        for i in 0..7 {
            t.push(i);
            assert_eq!(&*t, (0..=i).collect::<Vec<_>>().as_slice());
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(serde_json::from_str::<NewTokens>(&json).unwrap(), t);
        }
    }
}
