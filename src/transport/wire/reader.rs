//! The defensive byte reader both wire versions' decoders share, and the one conversion of a
//! length into the wire's u32.

use crate::error::EchoError;

/// A length or count as the wire's u32.
///
/// # Errors
/// [`EchoError::Config`] naming `what` when it does not fit.
pub(super) fn count(v: usize, what: &str) -> Result<u32, EchoError> {
    u32::try_from(v)
        .map_err(|_| EchoError::Config(format!("{what} {v} does not fit the wire format's u32")))
}

/// Reads little-endian values off a byte slice; running out is an `Io(UnexpectedEof)` error
/// (callers turn it into "need more bytes").
pub(super) struct Cursor<'a>(pub(super) &'a [u8]);

impl<'a> Cursor<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], EchoError> {
        if self.0.len() < n {
            return Err(EchoError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], EchoError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub(super) fn u8(&mut self) -> Result<u8, EchoError> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16, EchoError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(super) fn u32(&mut self) -> Result<u32, EchoError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(super) fn u64(&mut self) -> Result<u64, EchoError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}
