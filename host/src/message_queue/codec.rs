//! Message encoding: serde over postcard.
//!
//! Chosen after measuring bincode 2, bincode 1, postcard and rmp-serde on
//! an engine-step-shaped struct and a 1 MiB integer array (see the module
//! docs): bincode 2 encodes fastest, but it allocates a string's claimed
//! length before checking that the frame holds that many bytes, so a
//! corrupted 12-byte frame can ask for 2^60 bytes and abort the process.
//! postcard borrows strings and byte arrays from the frame before copying
//! them (a length past the frame's end is an error), gives a sequence whose
//! claimed length exceeds the bytes left no size hint, and lets serde cap the
//! pre-allocation of maps, so a frame can never make the decoder allocate
//! much more than its own size; its format is
//! stable and specified, and its varints make engine messages compact.
//! Large tensors should travel as bytes (`serde_bytes`), which postcard copies
//! with one `memcpy`.
//!
//! A frame is exactly one encoded value; its length travels in the chunk's
//! metadata. Decoding rejects trailing bytes, so a truncated frame (a strict
//! prefix of a self-delimiting encoding) or an extended one is always an
//! error; a corrupted one is an error or a different value, never a panic.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::error::QueueError;

/// Encodes `msg` into the front of `buf`. Returns the frame length, or
/// `Ok(None)` if `buf` is too small (the caller then sizes it with
/// [`encoded_len`] and retries in a larger place).
pub fn encode_into<T: Serialize + ?Sized>(
    msg: &T,
    buf: &mut [u8],
) -> Result<Option<usize>, QueueError> {
    match postcard::to_slice(msg, buf) {
        Ok(frame) => Ok(Some(frame.len())),
        Err(postcard::Error::SerializeBufferFull) => Ok(None),
        Err(e) => Err(QueueError::Encode(e.to_string())),
    }
}

/// The length of `msg`'s frame.
pub fn encoded_len<T: Serialize + ?Sized>(msg: &T) -> Result<usize, QueueError> {
    postcard::serialize_with_flavor::<T, _, usize>(msg, postcard::ser_flavors::Size::default())
        .map_err(|e| QueueError::Encode(e.to_string()))
}

/// Encodes `msg` into a new frame (for callers without a queue at hand).
pub fn encode<T: Serialize + ?Sized>(msg: &T) -> Result<Vec<u8>, QueueError> {
    postcard::to_stdvec(msg).map_err(|e| QueueError::Encode(e.to_string()))
}

/// Decodes one frame. Every byte must belong to the value.
pub fn decode<T: DeserializeOwned>(frame: &[u8]) -> Result<T, QueueError> {
    let err = |detail: String| QueueError::Decode {
        len: frame.len(),
        detail,
    };
    let (value, rest) = postcard::take_from_bytes(frame).map_err(|e| err(e.to_string()))?;
    if !rest.is_empty() {
        return Err(err(format!(
            "{} trailing bytes after the value",
            rest.len()
        )));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    /// A message shaped like the engine's traffic: nested, variable-length,
    /// with strings, options, enums and floats.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    enum Msg {
        Step {
            step: u64,
            reqs: Vec<Req>,
            finished: Vec<String>,
        },
        Rpc {
            method: String,
            args: BTreeMap<String, i64>,
            output_rank: Option<u32>,
        },
        Bytes(Vec<u8>),
        Shutdown,
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Req {
        id: String,
        tokens: Vec<u32>,
        temperature: f32,
        blocks: Vec<Vec<u32>>,
    }

    fn arb_msg() -> impl Strategy<Value = Msg> {
        let req = (
            ".{0,12}",
            prop::collection::vec(any::<u32>(), 0..20),
            any::<f32>().prop_filter("nan", |f| !f.is_nan()),
            prop::collection::vec(prop::collection::vec(any::<u32>(), 0..4), 0..4),
        )
            .prop_map(|(id, tokens, temperature, blocks)| Req {
                id,
                tokens,
                temperature,
                blocks,
            });
        prop_oneof![
            (
                any::<u64>(),
                prop::collection::vec(req, 0..5),
                prop::collection::vec(".{0,8}", 0..3)
            )
                .prop_map(|(step, reqs, finished)| Msg::Step {
                    step,
                    reqs,
                    finished
                }),
            (
                ".{0,16}",
                prop::collection::btree_map(".{0,6}", any::<i64>(), 0..4),
                any::<Option<u32>>()
            )
                .prop_map(|(method, args, output_rank)| Msg::Rpc {
                    method,
                    args,
                    output_rank
                }),
            prop::collection::vec(any::<u8>(), 0..300).prop_map(Msg::Bytes),
            Just(Msg::Shutdown),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn round_trips_and_knows_its_length(msg in arb_msg()) {
            let frame = encode(&msg).unwrap();
            prop_assert_eq!(encoded_len(&msg).unwrap(), frame.len());
            prop_assert_eq!(decode::<Msg>(&frame).unwrap(), msg);
        }

        #[test]
        fn every_truncation_and_extension_is_an_error(msg in arb_msg(), extra in prop::collection::vec(any::<u8>(), 1..8)) {
            let frame = encode(&msg).unwrap();
            for cut in 0..frame.len() {
                prop_assert!(decode::<Msg>(&frame[..cut]).is_err(), "prefix of {} bytes decoded", cut);
            }
            let mut longer = frame.clone();
            longer.extend_from_slice(&extra);
            prop_assert!(decode::<Msg>(&longer).is_err());
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<Msg>(&bytes);
            let _ = decode::<Vec<String>>(&bytes);
            let _ = decode::<(u64, Option<Vec<u32>>)>(&bytes);
        }

        #[test]
        fn mutated_frames_never_panic(msg in arb_msg(), edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
            let mut frame = encode(&msg).unwrap();
            if !frame.is_empty() {
                for (at, byte) in edits {
                    let i = at.index(frame.len());
                    frame[i] = byte;
                }
            }
            if let Ok(back) = decode::<Msg>(&frame) {
                // If it decodes, it is a well-formed value whose encoding round-trips.
                let again = encode(&back).unwrap();
                prop_assert_eq!(encode(&decode::<Msg>(&again).unwrap()).unwrap(), again);
            }
        }
    }

    #[test]
    fn a_huge_length_prefix_is_an_error_not_an_allocation() {
        // Sequences and strings claiming 2^62 elements (a varint) in a few bytes.
        let mut frame = vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f];
        frame.extend_from_slice(&[0; 4]);
        let err = decode::<Vec<u64>>(&frame).unwrap_err();
        assert!(err.to_string().contains("13 bytes"), "{err}");
        assert!(decode::<String>(&frame).is_err());
        assert!(decode::<Vec<String>>(&frame).is_err());
        assert!(decode::<Vec<Vec<u8>>>(&frame).is_err());
        assert!(decode::<BTreeMap<u64, String>>(&frame).is_err());
        assert!(decode::<std::collections::HashMap<u64, Vec<u8>>>(&frame).is_err());
    }

    #[test]
    fn a_too_small_buffer_asks_for_a_larger_one() {
        let msg = Msg::Bytes(vec![7; 100]);
        assert_eq!(encode_into(&msg, &mut [0; 50]).unwrap(), None);
        let mut big = [0; 200];
        assert_eq!(
            encode_into(&msg, &mut big).unwrap(),
            Some(encoded_len(&msg).unwrap())
        );
    }
}
