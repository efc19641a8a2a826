//! Typed GGUF metadata values and their lenient numeric accessors.

/// One GGUF metadata value, as stored (GGUF value types 0..=12).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 6.
    F32(f32),
    /// Type 12.
    F64(f64),
    /// Type 7.
    Bool(bool),
    /// Type 8 (UTF-8; invalid sequences are replaced with U+FFFD).
    String(String),
    /// Type 9: elements of one type, possibly arrays themselves.
    Array(Vec<Value>),
}

impl Value {
    /// The string, for [`Value::String`].
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer that is non-negative, widened to `u64`. Writers differ
    /// in which integer width they use for counts, so readers accept all.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Any integer that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any number (float or integer) as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The flag, for [`Value::Bool`].
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The elements, for [`Value::Array`].
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }

    /// The GGUF type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_widen_and_reject_out_of_range() {
        assert_eq!(Value::U8(7).as_u64(), Some(7));
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::I32(5).as_u64(), Some(5));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::I8(-3).as_i64(), Some(-3));
        assert_eq!(Value::F32(1.5).as_u64(), None);
        assert_eq!(Value::Bool(true).as_u64(), None);
    }

    #[test]
    fn floats_and_other_kinds() {
        assert_eq!(Value::F32(0.25).as_f64(), Some(0.25));
        assert_eq!(Value::U32(3).as_f64(), Some(3.0));
        assert_eq!(Value::String("x".into()).as_f64(), None);
        assert_eq!(Value::String("x".into()).as_str(), Some("x"));
        assert_eq!(Value::Bool(false).as_bool(), Some(false));
        assert_eq!(Value::U8(0).as_bool(), None);
        let arr = Value::Array(vec![Value::U8(1)]);
        assert_eq!(arr.as_array().map(<[Value]>::len), Some(1));
        assert_eq!(Value::U8(1).as_array(), None);
    }
}
