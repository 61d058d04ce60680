//! Page-locking the ring for GPU transfers: `cudaHostRegister` on every leaf buffer, so
//! host-to-device copies of a batch are real DMA instead of a staged copy.
//!
//! The CUDA runtime is loaded at run time (`dlopen`), never linked: echo builds and imports
//! on machines without CUDA, and only `pin_host_memory=True` needs it. A [`HostRegistration`]
//! unregisters its ranges when dropped; the store drops it before freeing the ring, and the
//! store lives until the last numpy view is gone, so memory is never unregistered under a view.

use std::ffi::{c_int, c_uint, c_void};
use std::path::PathBuf;

use libloading::{Library, Symbol};

use crate::error::EchoError;

/// `cudaHostRegisterPortable`: the pinning is visible to every CUDA context.
const CUDA_HOST_REGISTER_PORTABLE: c_uint = 1;

type HostRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int;
type HostUnregister = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetDeviceCount = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The page-locking of one owner's buffers (the FIFO ring, a replay table's batch area):
/// made on the first [`Pinning::pin`], kept until dropped.
#[derive(Debug, Default)]
pub(crate) struct Pinning(parking_lot::Mutex<Option<HostRegistration>>);

impl Pinning {
    /// Registers `ranges()` unless this already holds a registration. Idempotent.
    ///
    /// # Errors
    /// As [`HostRegistration::register`]; nothing stays registered then.
    ///
    /// # Safety
    /// As [`HostRegistration::register`]: every range is a live allocation that outlives this
    /// `Pinning` (its owner declares it before the buffers, so it is dropped first), and every
    /// path in `candidates` is a CUDA runtime.
    pub(crate) unsafe fn pin(
        &self,
        candidates: &[PathBuf],
        ranges: impl FnOnce() -> Vec<(*mut u8, usize)>,
    ) -> Result<(), EchoError> {
        let mut slot = self.0.lock();
        if slot.is_none() {
            // SAFETY: the caller's contract is `register`'s.
            *slot = Some(unsafe { HostRegistration::register(candidates, &ranges())? });
        }
        Ok(())
    }

    /// Whether the buffers are page-locked.
    pub(crate) fn is_pinned(&self) -> bool {
        self.0.lock().is_some()
    }
}

/// Ranges registered with `cudaHostRegister`, unregistered on drop.
pub struct HostRegistration {
    library: Library,
    ranges: Vec<(usize, usize)>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("ranges", &self.ranges.len()).finish()
    }
}

fn runtime_error(msg: String) -> EchoError {
    EchoError::Io(std::io::Error::other(msg))
}

impl HostRegistration {
    /// Loads the first CUDA runtime of `candidates` that opens, checks that a device exists
    /// and page-locks every `(address, length)` range.
    ///
    /// # Errors
    /// An [`EchoError::Io`] whose message says what is missing: no CUDA runtime library, no
    /// device, or the CUDA error code of a failed registration (earlier ranges are undone).
    ///
    /// # Safety
    /// Every range must be a live allocation that outlives the returned value (drop it before
    /// freeing them), and each library in `candidates` must be a CUDA runtime (or something
    /// with the same C signatures for the three functions used): loading it runs its
    /// initialisers.
    pub unsafe fn register(
        candidates: &[PathBuf],
        ranges: &[(*mut u8, usize)],
    ) -> Result<Self, EchoError> {
        let mut tried = Vec::new();
        let library = candidates.iter().find_map(|path| {
            // SAFETY: the caller vouches that the candidates are CUDA runtimes.
            match unsafe { Library::new(path) } {
                Ok(lib) => Some(lib),
                Err(err) => {
                    tried.push(format!("{}: {err}", path.display()));
                    None
                }
            }
        });
        let Some(library) = library else {
            return Err(runtime_error(format!(
                "pin_host_memory=True needs the CUDA runtime (libcudart), which could not be loaded; tried: {}",
                tried.join("; ")
            )));
        };
        let mut registration = Self { library, ranges: Vec::with_capacity(ranges.len()) };
        let missing = |e: libloading::Error| runtime_error(format!("not a CUDA runtime: {e}"));
        // SAFETY: the symbol has this C signature in every CUDA runtime.
        let count: Symbol<'_, GetDeviceCount> =
            unsafe { registration.library.get(b"cudaGetDeviceCount\0") }.map_err(missing)?;
        let mut devices: c_int = 0;
        // SAFETY: `devices` is a valid out-pointer for the duration of the call.
        let status = unsafe { count(&mut devices) };
        if status != 0 || devices < 1 {
            return Err(runtime_error(format!(
                "pin_host_memory=True needs a CUDA device: cudaGetDeviceCount returned error {status} with {devices} devices"
            )));
        }
        // SAFETY: as above, the CUDA runtime's C signature.
        let register: Symbol<'_, HostRegister> =
            unsafe { registration.library.get(b"cudaHostRegister\0") }.map_err(missing)?;
        let register = *register;
        for &(ptr, len) in ranges {
            if len == 0 {
                continue;
            }
            // SAFETY: the caller guarantees `ptr..ptr+len` is a live allocation that outlives
            // the registration, which `Drop` undoes.
            let status = unsafe { register(ptr.cast(), len, CUDA_HOST_REGISTER_PORTABLE) };
            if status != 0 {
                // Dropping `registration` unregisters the ranges done so far.
                return Err(runtime_error(format!(
                    "cudaHostRegister of {len} bytes failed with CUDA error {status}"
                )));
            }
            registration.ranges.push((ptr as usize, len));
        }
        Ok(registration)
    }

    /// Number of ranges registered.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: the CUDA runtime's C signature.
        let Ok(unregister) =
            (unsafe { self.library.get::<HostUnregister>(b"cudaHostUnregister\0") })
        else {
            return;
        };
        for &(addr, _) in &self.ranges {
            // SAFETY: `addr` was registered by `register` and the allocation is still live
            // (the owner drops this registration before freeing it).
            let status = unsafe { unregister(addr as *mut c_void) };
            if status != 0 {
                log::warn!("cudaHostUnregister failed with CUDA error {status}");
            }
        }
    }
}
