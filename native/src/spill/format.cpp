// Header encoding and file naming of the spill tier (layout in mcr/spill_format.h).
#include <cstring>

#include "mcr/spill_crc32c.h"
#include "mcr/spill_format.h"

namespace mcr::spill {
namespace {

constexpr char kMagic[8] = {'M', 'C', 'R', 'S', 'P', 'I', 'L', 'L'};

template <typename T>
void put(uint8_t* b, size_t off, T v) {
  std::memcpy(b + off, &v, sizeof v);  // x86-64 and aarch64 Linux: little endian
}
template <typename T>
T get(const uint8_t* b, size_t off) {
  T v;
  std::memcpy(&v, b + off, sizeof v);
  return v;
}

uint32_t header_crc(const uint8_t* b, const uint8_t* key, size_t key_len) {
  return crc32c(key, key_len, crc32c(b, 56));
}

int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

bool parse_hex16(std::string_view s, uint64_t* v) {
  if (s.size() != 16) return false;
  uint64_t x = 0;
  for (char c : s) {
    int d = hexval(c);
    if (d < 0) return false;
    x = x << 4 | static_cast<uint64_t>(d);
  }
  *v = x;
  return true;
}

}  // namespace

void encode_header(const Header& h, uint8_t* b) {
  uint32_t blocks = header_blocks_for(h.key.size());
  std::memset(b, 0, blocks * kBlock);
  std::memcpy(b, kMagic, 8);
  put<uint16_t>(b, 8, kFormatVersion);
  put<uint16_t>(b, 10, static_cast<uint16_t>(blocks));
  put<uint32_t>(b, 12, static_cast<uint32_t>(h.key.size()));
  put<uint64_t>(b, 16, h.gen);
  put<uint64_t>(b, 24, h.length);
  put<uint64_t>(b, 32, h.seq);
  put<uint64_t>(b, 40, h.write_time_ns);
  put<uint32_t>(b, 48, h.data_crc);
  put<uint32_t>(b, 52, h.flags);
  std::memcpy(b + kFixedHeader, h.key.data(), h.key.size());
  put<uint32_t>(b, 56, header_crc(b, b + kFixedHeader, h.key.size()));
}

bool decode_header(const uint8_t* b, size_t avail, Header* out, std::string* why) {
  if (avail < kFixedHeader) {
    *why = "file shorter than a header (" + std::to_string(avail) + " bytes)";
    return false;
  }
  if (std::memcmp(b, kMagic, 8) != 0) {
    *why = "bad magic";
    return false;
  }
  uint16_t version = get<uint16_t>(b, 8);
  if (version != kFormatVersion) {
    *why = "unknown format version " + std::to_string(version);
    return false;
  }
  uint32_t key_len = get<uint32_t>(b, 12);
  uint16_t blocks = get<uint16_t>(b, 10);
  if (key_len == 0 || key_len > kMaxKeyBytes || blocks != header_blocks_for(key_len)) {
    *why = "bad key length " + std::to_string(key_len) + " / header blocks " +
           std::to_string(blocks);
    return false;
  }
  if (avail < kFixedHeader + key_len) {
    *why = "header truncated";
    return false;
  }
  if (get<uint32_t>(b, 56) != header_crc(b, b + kFixedHeader, key_len)) {
    *why = "header checksum mismatch";
    return false;
  }
  out->key.assign(reinterpret_cast<const char*>(b + kFixedHeader), key_len);
  out->gen = get<uint64_t>(b, 16);
  out->length = get<uint64_t>(b, 24);
  out->seq = get<uint64_t>(b, 32);
  out->write_time_ns = get<uint64_t>(b, 40);
  out->data_crc = get<uint32_t>(b, 48);
  out->flags = get<uint32_t>(b, 52);
  out->header_blocks = blocks;
  if (out->flags & ~kFlagPack) {
    *why = "unknown header flags " + std::to_string(out->flags);
    return false;
  }
  return true;
}

namespace {
constexpr char kRecordMagic[4] = {'M', 'C', 'R', 'r'};

uint32_t record_crc(const uint8_t* b, size_t key_len) { return crc32c(b + kRecordHeader, key_len, crc32c(b, 36)); }
}  // namespace

void encode_record(const Record& r, const void* data, uint8_t* b) {
  uint64_t n = record_bytes(r.key.size(), r.length);
  std::memset(b, 0, kRecordHeader);
  std::memcpy(b, kRecordMagic, 4);
  put<uint16_t>(b, 4, static_cast<uint16_t>(r.key.size()));
  put<uint64_t>(b, 8, r.gen);
  put<uint64_t>(b, 16, r.length);
  put<uint64_t>(b, 24, r.seq);
  put<uint32_t>(b, 32, r.data_crc);
  std::memcpy(b + kRecordHeader, r.key.data(), r.key.size());
  put<uint32_t>(b, 36, record_crc(b, r.key.size()));
  uint8_t* d = b + kRecordHeader + r.key.size();
  if (r.length) std::memcpy(d, data, r.length);
  std::memset(d + r.length, 0, n - (kRecordHeader + r.key.size() + r.length));
}

bool decode_record(const uint8_t* b, size_t avail, Record* out, const uint8_t** data, std::string* why) {
  if (avail < kRecordHeader || std::memcmp(b, kRecordMagic, 4) != 0) {
    *why = avail < kRecordHeader ? "record truncated" : "bad record magic";
    return false;
  }
  uint16_t key_len = get<uint16_t>(b, 4);
  uint64_t length = get<uint64_t>(b, 16);
  if (key_len == 0 || key_len > kMaxKeyBytes || length > kPackBytes ||
      record_bytes(key_len, length) > avail) {
    *why = "record of key length " + std::to_string(key_len) + ", length " + std::to_string(length) +
           " does not fit";
    return false;
  }
  if (get<uint32_t>(b, 36) != record_crc(b, key_len)) {
    *why = "record header checksum mismatch";
    return false;
  }
  out->key.assign(reinterpret_cast<const char*>(b + kRecordHeader), key_len);
  out->gen = get<uint64_t>(b, 8);
  out->length = length;
  out->seq = get<uint64_t>(b, 24);
  out->data_crc = get<uint32_t>(b, 32);
  *data = b + kRecordHeader + key_len;
  return true;
}

std::string slot_name(uint64_t slot) {
  static const char* digits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[15 - i] = digits[(slot >> (4 * i)) & 15];
  return s;
}

bool parse_slot_name(std::string_view name, uint64_t* slot) { return parse_hex16(name, slot); }

}  // namespace mcr::spill
