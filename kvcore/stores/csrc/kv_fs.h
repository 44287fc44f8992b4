/* kv_fs.h: a DiskStore's directory listed, a batch of its entries
 * written, read or removed, each in one native call.
 *
 * A DiskStore holds the machine-wide PATH/.lock while it lists its
 * directory (every put), and the listing is a few system calls per
 * subdirectory and one per file.  From Python each of them gives up and
 * takes back the GIL; beside a thread that computes in Python the other
 * thread gets the GIL back only every switch interval (5 ms), so a
 * listing of a few hundred files took half a second under the lock, and
 * a put of a hundred small entries (eight calls each) took as long.
 * Here each is one call that runs without the GIL.
 *
 * Every name in the directory is untrusted: subdirectories are opened
 * without following a link, files are looked at with lstat semantics only
 * (fstatat AT_SYMLINK_NOFOLLOW), nothing is opened or read.
 */
#ifndef KV_FS_H
#define KV_FS_H

#include <stddef.h>
#include <stdint.h>

enum {
    KV_FS_ENTRY = 0,   /* a regular file named like an entry */
    KV_FS_BAD = 1,     /* named like an entry, neither a regular file nor a directory */
    KV_FS_STALE = 2,   /* a temporary file older than the cutoff */
};

typedef struct {
    size_t name;       /* offset of "SUBDIR/NAME\0" in kv_fs_scan.names */
    int64_t size;
    int64_t mtime_ns;
    int kind;          /* KV_FS_ENTRY, KV_FS_BAD or KV_FS_STALE */
} kv_fs_item;

typedef struct {
    kv_fs_item *items;
    size_t n, cap;
    char *names;
    size_t names_len, names_cap;
} kv_fs_scan;

/* List directory `root`: in each of its subdirectories (not links to
 * one), the files whose name ends with `suffix` (entries, or bad ones
 * when `want_bad`) and, when `want_stale`, those whose name starts with
 * `tmp_prefix` and whose mtime is before `stale_cutoff_ns`.  Names that
 * vanish or cannot be looked at are passed over, and so are
 * subdirectories that cannot be opened.  Returns 0, or an errno: the
 * root cannot be opened (ENOENT: 0 and nothing listed) or memory ran out.
 * Call kv_fs_scan_free on `out` in every case. */
int kv_fs_list(const char *root, const char *suffix, const char *tmp_prefix,
               int64_t stale_cutoff_ns, int want_stale, int want_bad, kv_fs_scan *out);
void kv_fs_scan_free(kv_fs_scan *scan);

/* What kv_fs_write returns besides 0 and an errno. */
#define KV_FS_NOT_OURS (-1)   /* the entry's place is a link, a directory ...: not written */
#define KV_FS_NO_ROOT (-2)    /* `root` itself is missing: nothing done */

/* Write `len` bytes at `data` as entry `root/sub/name`: `sub` created if
 * missing (not through a link), the bytes written to the temporary
 * `root/sub/tmp` (created exclusively, never through a link; one left by
 * a writer of the same name that died is replaced), then renamed over
 * `name`.  Sets `*grown` to the bytes the directory grew by (`len` less a
 * regular file replaced).  Returns 0, KV_FS_NOT_OURS (`sub` a link or not
 * a directory, a directory at `name`), KV_FS_NO_ROOT, or an errno (the
 * temporary file removed again; `*failed_tmp` set when the error concerns
 * it rather than the entry's directory or name). */
int kv_fs_write(const char *root, const char *sub, const char *name, const char *tmp,
                const void *data, size_t len, int64_t *grown, int *failed_tmp);

/* Open the regular file `path` to read (never through a link, its
 * directory neither; never blocking: a FIFO named like an entry) and read
 * its first bytes, at most `probe`, into `head`.  Sets `*fd` (to close
 * with kv_fs_read_close), `*size` (fstat's) and `*head_len`.  Returns 0,
 * KV_FS_NOT_OURS (a link, a directory, a FIFO, a device ...: nothing
 * open) or an errno (nothing open). */
int kv_fs_open_head(const char *path, void *head, size_t probe, int *fd, int64_t *size,
                    size_t *head_len);

/* Remove the file (or link, never what it points to) at `path`
 * ("DIR/NAME"), its directory opened without following a link: a
 * subdirectory swapped for a link since the listing gives ENOTDIR, and
 * nothing in the link's target is removed.  Returns 0 or an errno. */
int kv_fs_unlink(const char *path);

/* 1 when `path` ("DIR/NAME") is a regular file in a directory DIR that
 * is not a link (never followed): 0 otherwise. */
int kv_fs_is_entry(const char *path);

/* Remove `path` ("DIR/NAME", DIR opened without following a link) unless
 * it is a directory: 0 when removed (`*regular` 1 for a regular file of
 * `*size` bytes, 0 for anything else: a link, a FIFO ...), KV_FS_NOT_OURS
 * for a directory (left) or DIR a link or not a directory, ENOENT when
 * gone, or another errno. */
int kv_fs_delete(const char *path, int *regular, int64_t *size);

/* Read file `fd` from its start into `buf` until `len` bytes or its end
 * (EINTR retried), with `touch` set its modification time to now (the
 * LRU's recency of an entry read; a failure there is ignored), then
 * close it; `*got` is the bytes read.  Returns 0 or an errno (`fd` closed
 * in every case; `buf` NULL: only closed). */
int kv_fs_read_close(int fd, void *buf, size_t len, size_t *got, int touch);

#endif
