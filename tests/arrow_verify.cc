// tests/arrow_verify.cc -- the flatbuffers verifier over every message of Arrow IPC streams, as
// Arrow C++ (pyarrow) verifies each message's metadata before it reads it: nesting depth 128,
// alignment checked.  Built by tests/test_collect.py against flatc's code for tests/arrow_ipc.fbs.
//
//   arrow_verify FILE...   one line per file: its messages (a schema, then record batches) and
//                          the end-of-stream marker, each metadata verified, each body inside
//                          the file; exit 1 at the first failure, with a line naming it.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "arrow_ipc_generated.h"

static int check(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { printf("%s: cannot open\n", path); return 1; }
    std::vector<uint8_t> b;
    uint8_t chunk[1 << 16];
    for (size_t n; (n = fread(chunk, 1, sizeof chunk, f)) > 0;) b.insert(b.end(), chunk, chunk + n);
    fclose(f);
    size_t o = 0;
    int msgs = 0, batches = 0;
    for (;;) {
        uint32_t cont, len;
        if (o + 8 > b.size()) { printf("%s: no end-of-stream marker\n", path); return 1; }
        memcpy(&cont, &b[o], 4);
        memcpy(&len, &b[o + 4], 4);
        if (cont != 0xFFFFFFFFu) { printf("%s: message %d: no continuation marker\n", path, msgs); return 1; }
        o += 8;
        if (len == 0) break;
        if (len % 8 || o + len > b.size()) { printf("%s: message %d: bad metadata length %u\n", path, msgs, len); return 1; }
        flatbuffers::Verifier v(&b[o], len, 128, 8 * len);
        if (!ds4arrow::VerifyMessageBuffer(v)) { printf("%s: message %d: the flatbuffer does not verify\n", path, msgs); return 1; }
        const ds4arrow::Message *m = ds4arrow::GetMessage(&b[o]);
        const int want = msgs == 0 ? ds4arrow::MessageHeader_Schema : ds4arrow::MessageHeader_RecordBatch;
        if (m->version() != ds4arrow::MetadataVersion_V5 || m->header_type() != want) {
            printf("%s: message %d: version %d, header %d\n", path, msgs, (int)m->version(), (int)m->header_type());
            return 1;
        }
        o += len;
        const int64_t body = m->bodyLength();
        if (body < 0 || body % 8 || o + (uint64_t)body > b.size()) { printf("%s: message %d: bad body length\n", path, msgs); return 1; }
        if (want == ds4arrow::MessageHeader_RecordBatch) {
            const ds4arrow::RecordBatch *rb = m->header_as_RecordBatch();
            for (const ds4arrow::Buffer *bf : *rb->buffers())
                if (bf->offset() % 8 || bf->offset() + bf->length() > body) {
                    printf("%s: message %d: a buffer outside the body or not on 8 bytes\n", path, msgs);
                    return 1;
                }
            batches++;
        }
        o += (size_t)body;
        msgs++;
    }
    if (o != b.size()) { printf("%s: %zu bytes after the end-of-stream marker\n", path, b.size() - o); return 1; }
    printf("%s: verified: a schema, %d record batches, the end-of-stream marker\n", path, batches);
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (check(argv[i])) return 1;
    return 0;
}
