// Private to io/hdf5 (includes <hdf5.h>): an owning wrapper of one HDF5 identifier that closes it
// with the matching H5*close, so every early return and exception path releases what it opened.
#pragma once

#include <hdf5.h>

#include <utility>

namespace tessera::io::detail {

/// Owns one HDF5 identifier (file, group, dataset, dataspace, datatype, property list,
/// attribute) and closes it with the function it was created with.
class H5Handle {
 public:
  using Closer = herr_t (*)(hid_t);

  H5Handle() = default;
  /// Takes ownership of `id` (which may be negative: an invalid handle that closes nothing).
  H5Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  ~H5Handle() { close(); }
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;
  H5Handle(H5Handle&& other) noexcept
      : id_(std::exchange(other.id_, H5I_INVALID_HID)), closer_(other.closer_) {}
  H5Handle& operator=(H5Handle&& other) noexcept {
    if (this != &other) {
      close();
      id_ = std::exchange(other.id_, H5I_INVALID_HID);
      closer_ = other.closer_;
    }
    return *this;
  }

  /// The identifier, still owned by this handle.
  hid_t get() const { return id_; }
  /// True when the identifier is a valid (non-negative) one.
  bool valid() const { return id_ >= 0; }
  /// Closes the identifier now and returns the close status (0 when there was nothing to close);
  /// used where a failed close must be reported, e.g. the final flush of a written file.
  herr_t close() {
    herr_t status = 0;
    if (id_ >= 0 && closer_ != nullptr) status = closer_(id_);
    id_ = H5I_INVALID_HID;
    return status;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

/// A file identifier closed with H5Fclose.
inline H5Handle file_handle(hid_t id) {
  return H5Handle(id, H5Fclose);
}
/// A group, dataset or named datatype opened with H5Oopen (or H5Dcreate2), closed with H5Oclose.
inline H5Handle object_handle(hid_t id) {
  return H5Handle(id, H5Oclose);
}
/// A dataspace identifier closed with H5Sclose.
inline H5Handle space_handle(hid_t id) {
  return H5Handle(id, H5Sclose);
}
/// A datatype identifier closed with H5Tclose.
inline H5Handle type_handle(hid_t id) {
  return H5Handle(id, H5Tclose);
}
/// A property list identifier closed with H5Pclose.
inline H5Handle plist_handle(hid_t id) {
  return H5Handle(id, H5Pclose);
}
/// An attribute identifier closed with H5Aclose.
inline H5Handle attribute_handle(hid_t id) {
  return H5Handle(id, H5Aclose);
}

}  // namespace tessera::io::detail
